"""A served store's bounds on the wire: a batch over ``store.max_batch_keys`` is refused with a
clear message before any work, and a bound of the store's resources answers
RESOURCE_EXHAUSTED (the bounds themselves: tests/unit/store/test_limits.py)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.core.rpc import open_channel
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc

from support.helpers import start_store_process

PAGE = 4096


def namespace(model: str = "m") -> Namespace:
    return Namespace(
        model=model, dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
    )


def test_served_store_refuses_a_big_batch_with_a_clear_message(run_dir: Path) -> None:
    store = start_store_process(run_dir, "16MiB", env={"KVTIER_STORE__MAX_NAMESPACES": "1"})
    client = GrpcStoreClient(store.address, timeout_s=10)
    try:
        ns = namespace()
        ns_id = client.register_namespace(ns, PAGE)
        big = [i.to_bytes(16, "big") for i in range(16385)]  # the default cap is 16384
        for call in (
            lambda: client.lookup(ns_id, big, 5),
            lambda: client.allocate(ns_id, big, [PAGE] * len(big)),
            lambda: client.delete(ns_id, big),
        ):
            with pytest.raises(KvtierError) as err:
                call()
            assert err.value.code is ErrorCode.INVALID_ARGUMENT
            assert err.value.message == "batch of 16385 keys exceeds store.max_batch_keys = 16384"
        assert client.stats()["lookups"] == 0
        # A bound of the store's resources answers RESOURCE_EXHAUSTED on the wire.
        with pytest.raises(KvtierError) as err:
            client.register_namespace(namespace(model="second"), PAGE)
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED
        channel = open_channel(store.address)
        request = pb.RegisterNamespaceRequest(
            namespace_json=namespace(model="third").model_dump_json(), chunk_bytes=PAGE
        )
        with pytest.raises(grpc.RpcError) as rpc_err:
            store_pb2_grpc.StoreStub(channel).RegisterNamespace(request, timeout=10)
        assert rpc_err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        channel.close()
    finally:
        client.close()
        store.stop()
