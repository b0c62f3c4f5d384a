"""An insider (one tenant's ``engine`` credential) exhausting a store's memory: with huge
namespace definitions (``max_namespaces`` caps their count, not their size), or with read
leases taken until the store runs out (nothing capped them per client)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.core.rpc import ClientAuth, open_channel
from kvtier.store.client import wire
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc
from kvtier.testing.services import start_store

from support.secure_env import TOKENS, SecureStore, auth_env
from support.secure_store import CHUNK, client, namespace, put_chunks

MiB = 1 << 20


def _rss_anon(pid: int) -> int:
    """Private resident bytes of a process (its pool is shared memory: not counted)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/pid/status")


def _register_raw(store: SecureStore, namespace_json: str) -> grpc.StatusCode:
    """RegisterNamespace with a definition the client library would not even build."""
    channel = open_channel(store.address, ClientAuth(TOKENS["engine-a"]))
    try:
        store_pb2_grpc.StoreStub(channel).RegisterNamespace(
            pb.RegisterNamespaceRequest(namespace_json=namespace_json, chunk_bytes=CHUNK),
            timeout=30,
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined]
    finally:
        channel.close()


def _definition(**fields: object) -> str:
    return json.dumps({**json.loads(namespace("a").model_dump_json()), **fields})


def test_an_oversized_namespace_is_refused_and_memory_stays_flat(
    secure_store: SecureStore,
) -> None:
    pid = secure_store.service.proc.pid
    assert _register_raw(secure_store, _definition(model="warm-up")) is grpc.StatusCode.OK
    before = _rss_anon(pid)
    answers = [  # the attack: five 40 MiB definitions added 234 MiB to the store
        _register_raw(secure_store, _definition(model=f"{i}" + "m" * (40 * MiB))) for i in range(8)
    ]
    # Kept, these would be 320 MiB; refused, what remains is the gRPC and allocator buffers
    # one 40 MiB message leaves behind (measured: 10-70 MiB, not growing with the count).
    grown = _rss_anon(pid) - before
    assert grown < 128 * MiB, f"the store grew by {grown / MiB:.0f} MiB"
    assert answers == [grpc.StatusCode.INVALID_ARGUMENT] * 8
    # each field is bounded, however small the whole definition
    for field, value in (
        ("model", "m" * 4096),
        ("lora", "f" * 1024),
        ("tag", "t" * 4096),
        ("num_layers", 1 << 40),
    ):
        assert _register_raw(secure_store, _definition(**{field: value})) is (
            grpc.StatusCode.INVALID_ARGUMENT
        ), field
    # a long but real model path is fine, and the store still serves
    path = "/models/" + "/".join(["org", "family", "a-rather-long-model-name-v2"] * 4)
    assert _register_raw(secure_store, _definition(model=path)) is grpc.StatusCode.OK
    put_chunks(secure_store, TOKENS["engine-a"], "a")


def test_namespace_fields_are_bounded_in_the_model() -> None:
    """The same bound where a definition is built (connector, index): a clear error."""
    with pytest.raises(ValueError, match="model"):
        namespace("a").model_validate({**namespace("a").model_dump(), "model": "m" * 4096})
    assert Namespace.model_validate({**namespace("a").model_dump(), "model": "m" * 200})


@pytest.fixture(scope="module")
def capped_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStore]:
    run_dir = tmp_path_factory.mktemp("capped-store")
    env = {
        **auth_env(TOKENS["node"]),
        "KVTIER_STORE__MAX_LEASES_PER_SESSION": "4",
        "KVTIER_STORE__MAX_LEASED_CHUNKS_PER_SESSION": "10",
    }
    service = start_store(run_dir, "64MiB", "capped-node", remote=False, env=env)
    try:
        yield SecureStore(service, run_dir / "unused.sock")
    finally:
        service.stop()


def test_read_leases_per_session_are_capped(capped_store: SecureStore) -> None:
    ns_id, keys = put_chunks(capped_store, TOKENS["engine-a"], "a", n=4)
    greedy = client(capped_store, TOKENS["engine-a"])
    other = client(capped_store, TOKENS["engine-b"])
    try:
        held = [greedy.lookup(ns_id, keys[:1], 30).lease_id for _ in range(4)]
        assert all(held)
        with pytest.raises(KvtierError) as err:
            greedy.lookup(ns_id, keys[:1], 30)
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED
        assert "store.max_leases_per_session" in err.value.message
        # an unleased lookup still answers; another client still leases
        assert len(greedy.lookup(ns_id, keys).hits) == 4
        ns_b, keys_b = put_chunks(capped_store, TOKENS["engine-b"], "b", n=2)
        assert other.lookup(ns_b, keys_b, 30).lease_id
        # giving one back makes room again
        greedy.release(held[:1])
        assert greedy.lookup(ns_id, keys[:1], 30).lease_id
    finally:
        greedy.close()
        other.close()


def test_chunks_leased_per_session_are_capped(capped_store: SecureStore) -> None:
    """However few the leases, each pins chunks (one entry per key, duplicates too)."""
    ns_id, keys = put_chunks(capped_store, TOKENS["engine-a"], "a", n=4)
    greedy = client(capped_store, TOKENS["engine-a"])
    try:
        assert greedy.lookup(ns_id, keys * 2, 30).lease_id  # 8 chunk entries of 10
        with pytest.raises(KvtierError) as err:
            greedy.lookup(ns_id, keys, 30)
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED
        assert "store.max_leased_chunks_per_session" in err.value.message
        with pytest.raises(KvtierError) as err:  # allocations count too
            greedy.allocate(ns_id, [bytes(16 - 1) + bytes([i]) for i in range(4)], [CHUNK] * 4)
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED
        assert greedy.lookup(ns_id, keys[:2], 30).lease_id  # what is left fits
    finally:
        greedy.close()


def test_a_lease_without_a_session_is_refused(capped_store: SecureStore) -> None:
    """Else the per-session cap is bypassed by asking without one: a served store's leases
    always belong to a session (``GrpcStoreClient`` opens one on its first lease)."""
    ns_id, keys = put_chunks(capped_store, TOKENS["engine-a"], "a", n=1)
    channel = open_channel(capped_store.address, ClientAuth(TOKENS["engine-a"]))
    stub = store_pb2_grpc.StoreStub(channel)
    try:
        probe = client(capped_store, TOKENS["engine-a"])
        epoch = probe.info().epoch
        probe.close()
        for _ in range(6):
            with pytest.raises(grpc.RpcError) as err:
                stub.Lookup(
                    pb.LookupRequest(epoch=epoch, ns_id=ns_id, keys=keys[0], lease_ttl_s=30),
                    timeout=5,
                )
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "session" in err.value.details()  # type: ignore[attr-defined]
        unleased = stub.Lookup(pb.LookupRequest(epoch=epoch, ns_id=ns_id, keys=keys[0]), timeout=5)
        assert len(wire.locations_from_pb(unleased.hits)) == 1
    finally:
        channel.close()


def test_the_lease_caps_leave_real_engines_room() -> None:
    """The defaults against what a large engine holds at once: every running request's
    lookup (and its staging lookup) per rank, at 1024 sequences and 8 ranks; each pinning a
    128k-token prompt's 512 chunks at 256 sequences."""
    from kvtier.core.config.store import StoreConfig

    config = StoreConfig()
    assert config.max_leases_per_session >= 1024 * 2 * 8
    assert config.max_leased_chunks_per_session >= 256 * 512 * 8
