"""One suite for every index backend: the in-memory index, the gRPC client of a served
in-memory index, and the Redis index (a real redis-server), which must all behave the same.

The tests that import it (``from support.index_suite import *``) run it: each defines the
``backend`` fixture with the backends of its tier (tests/unit/index/test_backends.py:
memory and grpc, in this process; tests/integration/test_index_redis_backend.py: redis)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.chunks import Tier
from kvtier.core.config.index import IndexConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import (
    ApplyStatus,
    ChunkIndex,
    ChunkOp,
    Cursor,
    HeartbeatStatus,
    LocationKind,
    LocationStatus,
    Query,
    Registration,
)
from kvtier.index.backends.memory import MemoryIndex
from kvtier.index.backends.redis import RedisIndex
from kvtier.index.backends.redis_cluster import RedisClusterIndex
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.index.server.service import IndexService
from kvtier.store.api.events import EventKind
from kvtier.testing.redis_cluster import LocalRedisCluster

from support.helpers import RedisServer

STORED, REMOVED, CLEARED = EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED
GPU, CPU, DISK = Tier.GPU, Tier.CPU, Tier.DISK
NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=16
)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_index(
    kind: str, clock: Clock, redis_server: RedisServer | LocalRedisCluster | None
) -> ChunkIndex:
    if kind == "memory":
        return MemoryIndex(clock=clock)
    assert redis_server is not None
    prefix = f"t:{uuid.uuid4().hex[:8]}:"
    if kind.startswith("redis-cluster"):  # 4 shards over the cluster's 3 masters
        placement = "chunk" if kind == "redis-cluster-chunk" else "namespace"
        return RedisClusterIndex(
            redis_server.url, prefix=prefix, clock=clock, shards=4, placement=placement
        )
    return RedisIndex(redis_server.url, prefix=prefix, clock=clock)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def index(backend: str, clock: Clock, request: pytest.FixtureRequest) -> Iterator[ChunkIndex]:
    if backend == "grpc":  # a served in-memory index, through the typed client
        config = IndexConfig(grpc_port=0, http_port=0, heartbeat_timeout_s=1e9)
        service = IndexService.start(config, backend=MemoryIndex(clock=clock))
        client = GrpcIndexClient(service.grpc_address)
        try:
            yield client
        finally:
            client.close()
            service.stop()
        return
    fixture = {
        "redis": "redis_server",
        "redis-cluster": "redis_cluster",
        "redis-cluster-chunk": "redis_cluster",
    }.get(backend)
    server = request.getfixturevalue(fixture) if fixture else None
    idx = make_index(backend, clock, server)
    try:
        yield idx
    finally:
        if isinstance(idx, (RedisIndex, RedisClusterIndex)):
            idx.flush()
        idx.close()


def tokens(n_chunks: int, seed: int = 0) -> np.ndarray:
    return (
        np.random.default_rng(seed)
        .integers(0, 50_000, n_chunks * NS.chunk_tokens)
        .astype(np.uint32)
    )


def setup(index: ChunkIndex, *names: str, kind: LocationKind = LocationKind.INSTANCE) -> bytes:
    ns_id = index.register_namespace(NS)
    for name in names:
        index.register(Registration(name, kind, (ns_id,), node=f"node-of-{name}"))
    return ns_id


def stored(tier: Tier, ns_id: bytes, keys: list[bytes]) -> ChunkOp:
    return ChunkOp(STORED, tier, ns_id, tuple(keys))


def removed(tier: Tier, ns_id: bytes, keys: list[bytes]) -> ChunkOp:
    return ChunkOp(REMOVED, tier, ns_id, tuple(keys))


def runs(index: ChunkIndex, ns_id: bytes, keys: list[bytes]) -> dict[str, tuple[dict, int]]:
    result = index.query_one(Query(ns_id, keys=keys))
    assert result.num_chunks == len(keys)
    return {h.location: (dict(h.runs), h.total) for h in result.holdings}


def test_leading_runs_per_tier_and_across_tiers(index: ChunkIndex) -> None:
    ns_id = setup(index, "a", "b")
    keys = prompt_keys(NS, tokens(8))
    # a: GPU holds 0-3 and 5, CPU holds 4 and 6: any-tier run 7
    index.apply(
        "a", [stored(GPU, ns_id, [*keys[:4], keys[5]]), stored(CPU, ns_id, [keys[4], keys[6]])]
    )
    # b: CPU holds everything, GPU only chunk 1 (no leading run)
    index.apply("b", [stored(CPU, ns_id, keys), stored(GPU, ns_id, [keys[1]])])
    assert runs(index, ns_id, keys) == {"a": ({GPU: 4}, 7), "b": ({CPU: 8}, 8)}
    result = index.query_one(Query(ns_id, keys=keys))
    assert [h.location for h in result.holdings] == ["b", "a"]  # longest first
    assert result.best().node == "node-of-b" and result.best().kind is LocationKind.INSTANCE
    # a prefix of the prompt, and a prompt nobody holds
    assert runs(index, ns_id, keys[:2]) == {"a": ({GPU: 2}, 2), "b": ({CPU: 2}, 2)}
    other = prompt_keys(NS, tokens(3, seed=9))
    assert runs(index, ns_id, other) == {}
    assert runs(index, ns_id, []) == {}


def test_token_queries_and_batches(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    toks = tokens(6)
    keys = prompt_keys(NS, toks)
    index.apply("a", [stored(GPU, ns_id, keys[:5])])
    by_tokens, by_keys, partial = index.query(
        [
            Query(ns_id, tokens=list(map(int, toks))),
            Query(ns_id, keys=keys),
            Query(ns_id, tokens=toks[: 3 * NS.chunk_tokens + 5]),  # trailing partial chunk
        ]
    )
    assert by_tokens.holdings == by_keys.holdings and by_tokens.num_chunks == 6
    assert partial.num_chunks == 3 and partial.of("a").runs == {GPU: 3}


def test_bad_queries(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    with pytest.raises(KvtierError) as err:
        index.query_one(Query(b"\x01" * 16, keys=[]))
    assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
    store_ns = index.register_namespace(b"\x02" * 16)  # known by id only
    assert index.query_one(Query(store_ns, keys=[b"\x03" * 16])).holdings == ()
    with pytest.raises(KvtierError) as err:
        index.query_one(Query(store_ns, tokens=[1, 2, 3]))
    assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE and "by id only" in err.value.message
    with pytest.raises(KvtierError) as err:
        index.query_one(Query(ns_id, keys=[b"short"]))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvtierError) as err:
        index.query_one(Query(ns_id))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvtierError) as err:
        index.query_one(Query(ns_id, tokens=[-1] * 16))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_removed_and_cleared(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    keys = prompt_keys(NS, tokens(6))
    index.apply("a", [stored(GPU, ns_id, keys), stored(CPU, ns_id, keys[:3])])
    index.apply("a", [removed(GPU, ns_id, [keys[2]])])
    assert runs(index, ns_id, keys) == {"a": ({GPU: 2, CPU: 3}, 6)}  # CPU bridges chunk 2
    index.apply("a", [removed(GPU, ns_id, [keys[2]])])  # removing what is not there: no-op
    index.apply("a", [ChunkOp(CLEARED, CPU)])
    assert runs(index, ns_id, keys) == {"a": ({GPU: 2}, 2)}
    # ops apply in order: removed then stored again = held
    index.apply("a", [removed(GPU, ns_id, keys), stored(GPU, ns_id, keys[:4])])
    assert runs(index, ns_id, keys) == {"a": ({GPU: 4}, 4)}
    index.apply("a", [ChunkOp(CLEARED, None)])
    assert runs(index, ns_id, keys) == {}
    (info,) = index.locations()
    assert dict(info.entries) == {GPU: 0, CPU: 0, DISK: 0}


def test_cursor_duplicates_gaps_and_epochs(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    keys = prompt_keys(NS, tokens(4))
    op = [stored(GPU, ns_id, keys[:1])]
    # a sequenced writer starts with replace (the cursor is empty)
    assert index.apply("a", op, epoch=7, seq_from=1, seq_to=1) is ApplyStatus.RESYNC
    index.replace("a", {GPU: {ns_id: keys[:1]}}, epoch=7, seq=1)
    assert index.apply("a", op, epoch=7, seq_from=1, seq_to=1) is ApplyStatus.DUPLICATE
    assert index.apply("a", [stored(GPU, ns_id, keys[:2])], epoch=7, seq_from=2, seq_to=2) is (
        ApplyStatus.APPLIED
    )
    # an overlapping range re-applies in order
    assert index.apply("a", [stored(GPU, ns_id, keys[:3])], epoch=7, seq_from=2, seq_to=3) is (
        ApplyStatus.APPLIED
    )
    assert index.apply("a", op, epoch=7, seq_from=5, seq_to=5) is ApplyStatus.RESYNC  # gap
    assert index.apply("a", op, epoch=8, seq_from=4, seq_to=4) is ApplyStatus.RESYNC  # epoch
    assert runs(index, ns_id, keys) == {"a": ({GPU: 3}, 3)}
    assert index.locations()[0].cursor == Cursor(7, 3)
    # unsequenced writes always apply while the location is up
    assert index.apply("a", [stored(GPU, ns_id, keys)]) is ApplyStatus.APPLIED
    assert index.locations()[0].cursor == Cursor(7, 3)
    with pytest.raises(KvtierError) as err:
        index.apply("a", op, epoch=7, seq_from=5, seq_to=4)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_bad_batches_change_nothing(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    keys = prompt_keys(NS, tokens(3))
    good = stored(GPU, ns_id, keys)
    cases = [
        ("nobody", [good], ErrorCode.UNKNOWN_LOCATION),
        ("a", [good, stored(GPU, b"\x09" * 16, keys)], ErrorCode.UNKNOWN_NAMESPACE),
        ("a", [good, stored(GPU, ns_id, [b"\x00" * 15])], ErrorCode.INVALID_ARGUMENT),
        ("a", [good, stored(Tier.REMOTE, ns_id, keys)], ErrorCode.INVALID_ARGUMENT),
    ]
    for location, ops, code in cases:
        with pytest.raises(KvtierError) as err:
            index.apply(location, ops)
        assert err.value.code is code, (location, ops)
    assert runs(index, ns_id, keys) == {}
    with pytest.raises(KvtierError) as err:
        index.register(Registration("x", LocationKind.NODE, (b"\x08" * 16,)))
    assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
    with pytest.raises(KvtierError) as err:
        index.register(Registration("", LocationKind.NODE))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvtierError) as err:
        index.replace("nobody", {}, epoch=1, seq=1)
    assert err.value.code is ErrorCode.UNKNOWN_LOCATION


def test_replace_sets_the_whole_state(index: ChunkIndex) -> None:
    ns_id = setup(index, "n", kind=LocationKind.NODE)
    keys = prompt_keys(NS, tokens(5))
    index.apply("n", [stored(GPU, ns_id, keys), stored(DISK, ns_id, keys)])
    index.replace("n", {CPU: {ns_id: keys[:2]}}, epoch=3, seq=10)
    assert runs(index, ns_id, keys) == {"n": ({CPU: 2}, 2)}
    info = index.locations()[0]
    assert info.cursor == Cursor(3, 10) and dict(info.entries) == {GPU: 0, CPU: 2, DISK: 0}
    assert info.registration.kind is LocationKind.NODE


def test_heartbeats_reaping_and_relearning(index: ChunkIndex, clock: Clock) -> None:
    ns_id = setup(index, "a", "b")
    keys = prompt_keys(NS, tokens(3))
    index.replace("a", {GPU: {ns_id: keys}}, epoch=1, seq=1)
    index.replace("b", {GPU: {ns_id: keys}}, epoch=1, seq=1)
    clock.now += 20
    assert index.heartbeat(["b", "ghost"]) == [HeartbeatStatus.OK, HeartbeatStatus.UNKNOWN]
    clock.now += 15
    assert index.reap(30) == ["a"]  # silent 35 s; b spoke 15 s ago
    assert index.reap(30) == []
    assert runs(index, ns_id, keys) == {"b": ({GPU: 3}, 3)}
    status = {i.registration.location: i.status for i in index.locations()}
    assert status == {"a": LocationStatus.DOWN, "b": LocationStatus.UP}
    # a's writer keeps sending: told to resync; a heartbeat brings it up and asks the same
    assert index.apply("a", [stored(GPU, ns_id, keys)], epoch=1, seq_from=2, seq_to=2) is (
        ApplyStatus.RESYNC
    )
    assert index.apply("a", [stored(GPU, ns_id, keys)]) is ApplyStatus.RESYNC
    assert index.heartbeat(["a"]) == [HeartbeatStatus.RESYNC]
    assert index.apply("a", [], epoch=1, seq_from=2, seq_to=2) is ApplyStatus.RESYNC
    index.replace("a", {GPU: {ns_id: keys[:1]}}, epoch=2, seq=5)
    assert runs(index, ns_id, keys)["a"] == ({GPU: 1}, 1)
    assert index.heartbeat(["a"]) == [HeartbeatStatus.OK]


def test_recency(index: ChunkIndex, clock: Clock) -> None:
    ns_id = setup(index, "old", "new")
    keys = prompt_keys(NS, tokens(4))
    index.apply("old", [stored(GPU, ns_id, keys)])
    clock.now += 5
    index.apply("new", [stored(GPU, ns_id, keys[:3])])
    clock.now += 5
    index.apply("new", [stored(CPU, ns_id, keys[3:])])
    result = index.query_one(Query(ns_id, keys=keys))
    old, new = result.of("old"), result.of("new")
    assert new.total == old.total == 4
    assert new.stored_at == clock.now and old.stored_at == clock.now - 10
    assert new.last_seen == clock.now
    assert [h.location for h in result.holdings] == ["new", "old"]  # equal runs: freshest first
    assert index.query_one(Query(ns_id, keys=keys[:3])).of("new").stored_at == clock.now - 5


def test_unregister_frees_slots_without_leftovers(index: ChunkIndex) -> None:
    ns_id = setup(index, "a")
    keys = prompt_keys(NS, tokens(2))
    index.apply("a", [stored(GPU, ns_id, keys)])
    assert index.unregister("a") and not index.unregister("a")
    index.register(Registration("c", LocationKind.INSTANCE, (ns_id,)))  # may reuse a's slot
    assert runs(index, ns_id, keys) == {}
    with pytest.raises(KvtierError):
        index.apply("a", [])
    assert [i.registration.location for i in index.locations()] == ["c"]


def test_namespaces(index: ChunkIndex) -> None:
    ns_id = index.register_namespace(NS)
    assert ns_id == NS.root_key()
    store_ns = index.register_namespace(b"\x05" * 16)
    assert index.namespaces() == {ns_id: NS, store_ns: None}
    with pytest.raises(KvtierError):
        index.register_namespace(b"\x05" * 3)


# -- against a model: many locations (slots beyond 64 bits), every tier --------------------------

N_LOCS = 40  # 160 slots: bitmaps of 20 bytes


def model_runs(held: dict[tuple[int, Tier], set[int]], n: int) -> dict[str, tuple[dict, int]]:
    out = {}
    for loc in range(N_LOCS):
        tier_runs = {}
        for tier in (GPU, CPU, DISK):
            run = 0
            while run < n and run in held.get((loc, tier), set()):
                run += 1
            if run:
                tier_runs[tier] = run
        total = 0
        while total < n and any(total in held.get((loc, t), set()) for t in (GPU, CPU, DISK)):
            total += 1
        if total:
            out[f"loc{loc}"] = (tier_runs, total)
    return out


op_strategy = st.tuples(
    st.integers(0, N_LOCS - 1),
    st.sampled_from([GPU, CPU, DISK]),
    st.sampled_from([STORED, STORED, REMOVED, CLEARED]),
    st.integers(0, 11),
    st.integers(1, 12),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op_strategy, min_size=1, max_size=60))
def test_matches_a_model(index: ChunkIndex, ops: list) -> None:
    ns_id = index.register_namespace(NS)
    if not index.locations():
        for loc in range(N_LOCS):
            index.register(Registration(f"loc{loc}", LocationKind.INSTANCE, (ns_id,)))
    for loc in range(N_LOCS):
        index.apply(f"loc{loc}", [ChunkOp(CLEARED, None)])
    keys = prompt_keys(NS, tokens(12))
    held: dict[tuple[int, Tier], set[int]] = {}
    for loc, tier, kind, start, length in ops:
        chosen = list(range(start, min(12, start + length)))
        if kind is CLEARED:
            index.apply(f"loc{loc}", [ChunkOp(CLEARED, tier)])
            held[(loc, tier)] = set()
        else:
            index.apply(f"loc{loc}", [ChunkOp(kind, tier, ns_id, tuple(keys[i] for i in chosen))])
            s = held.setdefault((loc, tier), set())
            if kind is STORED:
                s.update(chosen)
            else:
                s.difference_update(chosen)
    for n in (12, 5, 1):
        assert runs(index, ns_id, keys[:n]) == model_runs(held, n)
