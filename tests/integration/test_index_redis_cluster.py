"""The index backends' one suite (tests/support/index_suite.py) on Redis Cluster: the index cut
into 4 shards over a real 3-master cluster, by namespace and by chunk (failover and resharding:
tests/integration/test_index_redis_cluster_faults.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import chunk_keys
from kvtier.index.api import ApplyStatus, ChunkOp, IndexHealth, LocationKind, Registration
from kvtier.index.backends.redis_cluster import RedisClusterIndex
from kvtier.store.api.events import EventKind
from kvtier.testing.redis_cluster import LocalRedisCluster

from support.index_suite import *  # noqa: F403  (the suite's fixtures and tests run here)
from support.index_suite import GPU, NS, Clock, make_index, runs, stored, tokens


@pytest.fixture(params=["redis-cluster", "redis-cluster-chunk"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


# -- what only the cluster has -----------------------------------------------------------------


@pytest.fixture
def cluster_index(redis_cluster: LocalRedisCluster, clock: Clock) -> Iterator[RedisClusterIndex]:
    idx = make_index("redis-cluster", clock, redis_cluster)
    assert isinstance(idx, RedisClusterIndex)
    try:
        yield idx
    finally:
        idx.flush()
        idx.close()


def two_shards(index: RedisClusterIndex) -> tuple[bytes, bytes]:
    """Two registered namespaces whose chunks live in different shards."""
    first = index.register_namespace(NS)
    for i in range(100):
        other = NS.model_copy(update={"model": f"m{i}"})
        if index.shard_of(other.root_key()) != index.shard_of(first):
            return first, index.register_namespace(other)
    raise AssertionError("no namespace in another shard")


def test_batches_skip_untouched_shards_and_gaps_still_resync(
    cluster_index: RedisClusterIndex,
) -> None:
    """Batches of one namespace leave the other shard's cursor behind; the next batch there
    picks up from it, and a gap in the writer's sequence is still a RESYNC everywhere."""
    a, b = two_shards(cluster_index)
    cluster_index.register(Registration("i0", LocationKind.INSTANCE, (a, b)))
    cluster_index.replace("i0", {}, epoch=1, seq=0)
    keys_a, keys_b = chunk_keys(a, tokens(4), 16), chunk_keys(b, tokens(4, seed=1), 16)
    for seq in (1, 2):
        status = cluster_index.apply(
            "i0", [stored(GPU, a, keys_a)], epoch=1, seq_from=seq, seq_to=seq
        )
        assert status is ApplyStatus.APPLIED
    status = cluster_index.apply("i0", [stored(GPU, b, keys_b)], epoch=1, seq_from=3, seq_to=3)
    assert status is ApplyStatus.APPLIED
    assert runs(cluster_index, b, keys_b)["i0"][1] == 4
    # the least of the shards' cursors: two shards took batch 1 (sent everywhere, the first
    # this process saw) and nothing since, which a writer resuming from 1 replays harmlessly
    assert cluster_index.location("i0").cursor.seq == 1  # type: ignore[union-attr]
    gap = cluster_index.apply("i0", [stored(GPU, a, keys_a)], epoch=1, seq_from=5, seq_to=5)
    assert gap is ApplyStatus.RESYNC


def test_a_process_with_another_shard_count_is_refused(
    cluster_index: RedisClusterIndex, redis_cluster: LocalRedisCluster, clock: Clock
) -> None:
    cluster_index.register_namespace(NS)
    other = RedisClusterIndex(redis_cluster.url, prefix=cluster_index.prefix, clock=clock, shards=3)
    try:
        with pytest.raises(KvtierError) as refused:
            other.register_namespace(NS)
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT
        assert other.health()[0] is IndexHealth.DEGRADED
    finally:
        other.close()


def test_chunk_placement_spreads_one_namespace_over_every_shard(
    redis_cluster: LocalRedisCluster, clock: Clock
) -> None:
    """Placement ``chunk``: one namespace's chunks land in every shard (so its writes reach
    every master), a prompt's run is whole across them, and a chunk one shard lost cuts it
    there; a process with the other placement is refused."""
    index = make_index("redis-cluster-chunk", clock, redis_cluster)
    assert isinstance(index, RedisClusterIndex)
    try:
        ns_id = index.register_namespace(NS)
        index.register(Registration("i0", LocationKind.INSTANCE, (ns_id,)))
        keys = chunk_keys(ns_id, tokens(64), 16)
        index.apply("i0", [stored(GPU, ns_id, keys)])
        per_shard = [shard.location("i0").entries[GPU] for shard in index._shards]  # type: ignore[union-attr]
        assert all(per_shard) and sum(per_shard) == 64, per_shard
        assert runs(index, ns_id, keys)["i0"] == ({GPU: 64}, 64)
        index.apply("i0", [ChunkOp(EventKind.REMOVED, GPU, ns_id, (keys[40],))])
        assert runs(index, ns_id, keys)["i0"] == ({GPU: 40}, 40)

        other = RedisClusterIndex(redis_cluster.url, prefix=index.prefix, clock=clock, shards=4)
        try:
            with pytest.raises(KvtierError) as refused:
                other.register_namespace(NS)
            assert refused.value.code is ErrorCode.INVALID_ARGUMENT
            assert "redis_placement" in refused.value.message
        finally:
            other.close()
    finally:
        index.flush()
        index.close()


def test_the_ingest_benchmark_applies_coalesced_batches_with_their_seq_range(
    redis_cluster: LocalRedisCluster,
) -> None:
    """``kvtier bench index``'s ingest: several vLLM batches in one apply carry the seq range
    they cover, so the index's cursor check accepts them and the location holds the chunks."""
    from kvtier.bench.micro.index_redis import measure_ingest, redis_index

    with redis_index("redis-cluster-chunk", redis_cluster.url, "t:bench:", 3) as (idx, masters):
        row = measure_ingest(idx, masters, namespaces=1, prompts=4, coalesce=3)
        info = idx.location("vllm-0")
        assert info is not None and info.cursor.seq > 1
        assert info.entries[GPU] > 0
    assert row["coalesce"] == 3 and row["blocks"] > 0
    assert len(row["server_cpu_s_per_master"]) == 3
