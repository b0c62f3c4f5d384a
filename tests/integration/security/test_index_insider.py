"""The index against the holder of one tenant's engine credential: real index processes
(memory and Redis backends), real stores, loopback.

- Another tenant's namespace answers exactly as one never registered, in every call.
- A location is written only by the credential that registered it; engines announce
  instances, never store endpoints; the index presents its token only to a store that proved
  it holds the credential that registered it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import prompt_keys
from kvtier.index.api import ChunkOp, LocationKind, Query, Registration
from kvtier.index.ingest.vllm_wire import BlockStored
from kvtier.store.api.events import EventKind
from kvtier.testing.ports import free_port
from kvtier.testing.services import Service

from support.grpc_recorder import GrpcRecorder
from support.helpers import RedisServer
from support.index_rig import (
    NS_A,
    NS_B,
    client,
    http,
    namespace,
    refused,
    start_index,
)
from support.secure_env import SALTS, TOKENS, SecureStore, auth_env, credentials
from support.vllm_fixtures import FaultyPublisher, wait_for

TOKEN_IDS = list(range(500, 500 + 4 * 16))
KEYS = prompt_keys(NS_B, TOKEN_IDS)  # tenant b's keys of a prompt
NEVER = b"\x99" * 16  # a namespace id nobody registered


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[Service]:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    service = start_index(redis_url=url)
    try:
        yield service
    finally:
        service.stop()


def _same(got: Exception, want: Exception, got_id: bytes, want_id: bytes) -> None:
    """The same code and, but for the id asked about, the same message."""
    assert got.code is want.code, (got, want)  # type: ignore[attr-defined]
    assert got.message.replace(got_id.hex(), "<id>") == want.message.replace(  # type: ignore[attr-defined]
        want_id.hex(), "<id>"
    )


def test_another_tenants_namespace_answers_as_never_registered(index: Service) -> None:
    b, a, node, reader = (client(index, w) for w in ("engine-b", "engine-a", "node", "reader"))
    ns_a = a.register_namespace(NS_A)
    ns_b = b.register_namespace(NS_B)
    b.register(Registration("vllm-b", LocationKind.INSTANCE, (ns_b,), node="n1"))
    b.apply("vllm-b", [ChunkOp(EventKind.STORED, Tier.GPU, ns_b, tuple(KEYS))])
    ns_store = node.register_namespace(b"\x42" * 16)  # what a store's events name: an id only
    node.register(Registration("node-s", LocationKind.NODE, (ns_store,)))
    # routers (no tenant) see both
    assert reader.query_one(Query(ns_b, tokens=TOKEN_IDS)).of("vllm-b").runs == {Tier.GPU: 4}
    assert reader.query_one(Query(ns_store, keys=KEYS)).num_chunks == 4

    for ns in (ns_b, ns_store):
        for asked, never in (
            (Query(ns, keys=KEYS), Query(NEVER, keys=KEYS)),
            (Query(ns, tokens=TOKEN_IDS), Query(NEVER, tokens=TOKEN_IDS)),
        ):
            _same(refused(a.query_one, asked), refused(a.query_one, never), ns, NEVER)
            got = http(f"{index.http}/query", TOKENS["engine-a"], {"ns": ns.hex(), "keys": []})
            want = http(f"{index.http}/query", TOKENS["engine-a"], {"ns": NEVER.hex(), "keys": []})
            assert got[0] == want[0] == 404
            assert got[1].replace(ns.hex(), "<id>") == want[1].replace(NEVER.hex(), "<id>")
        # in a batch, behind another unknown one: that one still answers first, as it would
        # were this one never registered
        first = Query(b"\x98" * 16, keys=KEYS)
        got = refused(a.query, [first, Query(ns, keys=KEYS)])
        assert got.message == refused(a.query, [first, Query(NEVER, keys=KEYS)]).message
        assert (b"\x98" * 16).hex() in got.message
        # naming it in a registration or a write: as unknown too
        unknown_reg = Registration("vllm-a", LocationKind.INSTANCE, (NEVER,))
        _same(
            refused(a.register, Registration("vllm-a", LocationKind.INSTANCE, (ns,))),
            refused(a.register, unknown_reg), ns, NEVER,
        )  # fmt: skip

    # lists name none of them, over gRPC and HTTP
    a.register(Registration("vllm-a", LocationKind.INSTANCE, (ns_a,)))
    shown = [
        json.dumps([[n.hex() for n in i.registration.namespaces] for i in a.locations()]),
        json.dumps(a.stats()),
        http(f"{index.http}/locations", TOKENS["engine-a"])[1],
        http(f"{index.http}/stats", TOKENS["engine-a"])[1],
    ]
    for text in shown:
        assert ns_b.hex() not in text and ns_store.hex() not in text, text
        assert ns_a.hex() in text  # its own, yes
    # the location itself is no secret (routers pick it): only the namespace leaves the list
    assert "vllm-b" in {i.registration.location for i in a.locations()}

    # writes into tenant b's namespace from tenant a's own location: as an unknown namespace
    plant = ChunkOp(EventKind.STORED, Tier.GPU, ns_b, tuple(KEYS))
    never_op = ChunkOp(EventKind.STORED, Tier.GPU, NEVER, tuple(KEYS))
    _same(refused(a.apply, "vllm-a", [plant]), refused(a.apply, "vllm-a", [never_op]), ns_b, NEVER)
    _same(
        refused(a.replace, "vllm-a", {Tier.GPU: {ns_b: KEYS}}, epoch=1, seq=1),
        refused(a.replace, "vllm-a", {Tier.GPU: {NEVER: KEYS}}, epoch=1, seq=1), ns_b, NEVER,
    )  # fmt: skip
    assert reader.query_one(Query(ns_b, keys=KEYS)).best().location == "vllm-b"

    # registering namespaces: its own tenant's only, as the store does
    for other in (NS_B, namespace(None), namespace(SALTS["b"], model="other")):
        assert refused(a.register_namespace, other).code is ErrorCode.PERMISSION_DENIED
    assert refused(a.register_namespace, NEVER).code is ErrorCode.PERMISSION_DENIED  # no tenant
    assert a.register_namespace(namespace(SALTS["a"], model="mine")) is not None
    for c in (a, b, node, reader):
        c.close()


def test_only_the_registrant_writes_a_location(index: Service) -> None:
    b, a, other, admin, reader = (
        client(index, w) for w in ("engine-b", "engine-a", "engine-all", "admin", "reader")
    )
    ns_b = b.register_namespace(NS_B)
    b.register(Registration("vllm-b", LocationKind.INSTANCE, (ns_b,)))
    b.apply("vllm-b", [ChunkOp(EventKind.STORED, Tier.GPU, ns_b, tuple(KEYS))])
    fake = ChunkOp(EventKind.STORED, Tier.CPU, ns_b, tuple(KEYS))
    for intruder in (a, other):  # another tenant, and an engine of every tenant
        for call, args, kwargs in (
            (intruder.apply, ("vllm-b", [fake]), {}),
            (intruder.apply, ("vllm-b", [ChunkOp(EventKind.CLEARED, None)]), {}),
            (intruder.replace, ("vllm-b", {}), {"epoch": 1, "seq": 10**12}),
            (intruder.heartbeat, (["vllm-b"],), {}),
            (intruder.unregister, ("vllm-b",), {}),
            (intruder.register, (Registration("vllm-b", LocationKind.INSTANCE, ()),), {}),
            (intruder.claim, ("vllm-b", "me", 3600.0), {}),
        ):
            assert refused(call, *args, **kwargs).code is ErrorCode.PERMISSION_DENIED, call
    held = reader.query_one(Query(ns_b, keys=KEYS)).of("vllm-b")
    assert held is not None and held.runs == {Tier.GPU: 4}  # nothing moved
    # its registrant writes it; an admin may too
    assert b.heartbeat(["vllm-b"])[0].value == "ok"
    assert b.apply("vllm-b", [fake]).value == "applied"
    assert admin.unregister("vllm-b")
    for c in (a, b, other, admin, reader):
        c.close()


def test_engines_announce_instances_and_a_store_endpoint_never_gets_the_token() -> None:
    index = start_index()
    recorder = GrpcRecorder()
    try:
        engine, node = client(index, "engine-all"), client(index, "node")
        for reg in (
            Registration("evil", LocationKind.NODE, endpoints={"store": recorder.address}),
            Registration("evil", LocationKind.INSTANCE, endpoints={"store": recorder.address}),
        ):
            assert refused(engine.register, reg).code is ErrorCode.PERMISSION_DENIED
        # a node credential may announce a store: the index dials it, and asks it to prove
        # it holds that credential before presenting anything
        node.register(
            Registration("evil", LocationKind.NODE, endpoints={"store": recorder.address})
        )
        wait_for(lambda: recorder.metadata, timeout=30, what="the index dialing the endpoint")
        time.sleep(1.0)  # a few more probe intervals
        assert not any(TOKENS["index"] in value for _, value in recorder.metadata)
        assert not any("index-token" in value for _, value in recorder.metadata)
        engine.close()
        node.close()
    finally:
        recorder.server.stop(0)
        index.stop()


NODE2 = "node-2-token-0123456789"


def test_a_store_is_followed_only_for_the_credential_it_proves(
    secure_store: SecureStore,
) -> None:
    """The store proves the credential "node": registered by "node-2" (another store's
    credential), or under another node's name, the index does not follow it."""
    creds = [*credentials(), {"name": "node-2", "token": NODE2, "role": "node", "tenants": []}]
    env = {**auth_env(TOKENS["index"]), "KVTIER_AUTH__CREDENTIALS": json.dumps(creds)}
    index = start_index(env=env)
    try:
        from kvtier.core.rpc import ClientAuth
        from kvtier.index.client.grpc import GrpcIndexClient

        admin = client(index, "admin")
        node2 = GrpcIndexClient(index.address, 10, auth=ClientAuth(NODE2))
        node = client(index, "node")
        endpoint = {"store": secure_store.address}

        def source(name: str) -> dict | None:
            return next((s for s in admin.stats()["sources"] if s["source"] == name), None)

        node2.register(Registration("secure-node", LocationKind.NODE, endpoints=endpoint))
        failed = wait_for(
            lambda: (s := source(secure_store.address)) and s["state"] == "failed" and s,
            timeout=30, what="the follower refusing the store",
        )  # fmt: skip
        assert "proved credential 'node', not 'node-2'" in failed["detail"]
        assert node2.unregister("secure-node")
        node.register(Registration("other-node", LocationKind.NODE, endpoints=endpoint))
        failed = wait_for(
            lambda: (s := source(secure_store.address)) and "registered as" in s["detail"] and s,
            timeout=30, what="the follower refusing a store under another node's name",
        )  # fmt: skip
        assert node.unregister("other-node")
        node.register(Registration("secure-node", LocationKind.NODE, endpoints=endpoint))
        wait_for(
            lambda: (s := source("secure-node")) and s["state"] == "live",
            timeout=30, what="the store followed for its own credential",
        )  # fmt: skip
        for c in (admin, node2, node):
            c.close()
    finally:
        index.stop()


def test_a_followed_store_is_written_by_its_follower_only(secure_store: SecureStore) -> None:
    """Nobody over the API, not even its registrant or an admin, can blind the index to a
    store it follows (a Replace with a cursor far ahead did) or drop it."""
    from kvtier.core.rpc import ClientAuth
    from kvtier.index.client.grpc import GrpcIndexClient
    from kvtier.store.client.grpc import GrpcStoreClient
    from kvtier.tiers.cpu import CpuTier

    index = start_index("--store", secure_store.address, env={"KVTIER_INDEX__SOURCE_GRACE_S": "2"})
    engine = GrpcStoreClient(secure_store.address, 5, auth=ClientAuth(TOKENS["engine-a"]))
    reader = client(index, "reader")
    try:
        wait_for(
            lambda: any(i.registration.location == "secure-node" for i in reader.locations()),
            timeout=30, what="the store followed",
        )  # fmt: skip
        for who in ("engine-a", "node", "admin"):
            c: GrpcIndexClient = client(index, who)
            for call, args, kwargs in (
                (c.replace, ("secure-node", {}), {"epoch": 1, "seq": 10**12}),
                (c.apply, ("secure-node", [ChunkOp(EventKind.CLEARED, None)]), {}),
                (c.heartbeat, (["secure-node"],), {}),
            ):
                assert refused(call, *args, **kwargs).code is ErrorCode.PERMISSION_DENIED
            c.close()
        engine_idx = client(index, "engine-a")
        assert refused(engine_idx.unregister, "secure-node").code is ErrorCode.PERMISSION_DENIED
        engine_idx.close()
        # and it keeps learning: a chunk committed now is indexed
        ns = NS_A
        keys = prompt_keys(ns, np.arange(3 * ns.chunk_tokens, dtype=np.uint32))
        with CpuTier(engine) as tier:
            ns_id = tier.register_namespace(ns, 4096)
            tier.put(ns_id, keys, [np.zeros(4096, np.uint8)] * len(keys))

        def held() -> int:
            try:
                h = reader.query_one(Query(ns_id, keys=keys)).of("secure-node")
            except Exception:  # not registered yet
                return 0
            return h.runs.get(Tier.CPU, 0) if h else 0

        wait_for(lambda: held() == 3, timeout=30, what="the store's chunks indexed")
        status, _ = http(f"{index.http}/readyz")
        assert status == 200
    finally:
        reader.close()
        index.stop()


def test_owners_outlive_the_index_process(redis_server: RedisServer) -> None:
    """Who registered a location is kept in Redis: a new index process enforces it too."""
    prefix = f"t:{uuid.uuid4().hex[:8]}:"
    index = start_index(redis_url=redis_server.url, prefix=prefix)
    b = client(index, "engine-b")
    ns_b = b.register_namespace(NS_B)
    b.register(Registration("vllm-b", LocationKind.INSTANCE, (ns_b,)))
    b.close()
    index.stop()
    index = start_index(redis_url=redis_server.url, prefix=prefix)
    try:
        a, b = client(index, "engine-a"), client(index, "engine-b")
        clear = [ChunkOp(EventKind.CLEARED, None)]
        assert refused(a.apply, "vllm-b", clear).code is ErrorCode.PERMISSION_DENIED
        assert b.apply("vllm-b", clear).value == "applied"
        a.close()
        b.close()
    finally:
        index.stop()


def test_a_followed_engine_writes_only_its_registrants_tenants(index: Service) -> None:
    """An engine of tenant a registers its event endpoints; events naming tenant b's salt
    (the events are the engine's to write) land nowhere: the follower writes on behalf of
    the credential that registered it, tenant a's namespaces only."""
    port, replay = free_port(), free_port()
    publisher = FaultyPublisher(port, replay)
    a, reader = client(index, "engine-a"), client(index, "reader")
    try:
        ns_a = a.register_namespace(NS_A)
        endpoints = {"events": f"tcp://127.0.0.1:{port}", "replay": f"tcp://127.0.0.1:{replay}",
                     "topic": "kv"}  # fmt: skip
        a.register(Registration("vllm-a", LocationKind.INSTANCE, (ns_a,), "n1", endpoints))

        def stored(first: int, salt: str) -> BlockStored:
            return BlockStored(
                block_hashes=[first, first + 1, first + 2, first + 3], parent_block_hash=None,
                token_ids=TOKEN_IDS, block_size=16, lora_id=None, medium="GPU",
                lora_name=None, extra_keys=[(salt,), None, None, None],
            )  # fmt: skip

        publisher.publish([stored(100, SALTS["b"]), stored(200, SALTS["a"])])

        def run(ns: bytes) -> int:
            try:
                held = reader.query_one(Query(ns, tokens=TOKEN_IDS)).of("vllm-a")
            except KvtierError:
                return 0
            return held.total if held else 0

        wait_for(lambda: run(ns_a) == 4, timeout=30, what="tenant a's blocks indexed")
        assert run(NS_B.root_key()) == 0  # tenant b's: never written
        source = next(s for s in reader.stats()["sources"] if s["source"] == "vllm-a")
        assert source["rejected"].get("foreign_namespace") == 1
        assert NS_B.root_key() not in reader.namespaces()
    finally:
        a.close()
        reader.close()
        publisher.close()
