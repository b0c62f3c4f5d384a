"""Index benchmarks on one Redis and on Redis Cluster: query latency, ingest, fleet capacity.

Started here unless given: a ``redis-server`` on a free port, and a 3-master cluster (a replica
each) from ``kvtier.testing.redis_cluster``. The cluster index is cut into 6 shards, by
namespace (``redis-cluster``) or by chunk (``redis-cluster-chunk``: ``index.redis_placement``).

Ingest: vLLM ``BlockStored`` batches (as ``index.vllm_stream`` makes them) decoded, mapped to
chunk ops and applied with cursors, as a follower applies them, by one client thread: the rate
one index process reaches. Index replicas split the sources between them, so a fleet's ingest
is bounded by the Redis side: the CPU each master spent (``INFO cpu``, before and after) gives
blocks per master-core-second, and the busiest master saturates first. A fleet spreads over
masters by namespace, or, placed by chunk, one namespace's too; the runs use 1 namespace and
6 (one per model or tenant salt).

Fleet rate: an instance prefilling without pause computes ``FLEET_PREFILL_TOKENS_S`` uncached
tokens a second, i.e. that / 16 stored blocks, and evicts as many (removals cost the same), so
``2 * FLEET_PREFILL_TOKENS_S / 16`` block events a second: the 8k row of
../shared/docs/reference-numbers.md (one H20, Qwen3-30B-A3B, 8,192 tokens prefilled in
0.588 s), the fastest prefill there. "Instances held" = capacity / that rate: an upper bound on
events, so a lower bound on instances.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from kvtier.core.chunks import Tier
from kvtier.index.api import ChunkIndex, LocationKind, Registration
from kvtier.index.backends.redis import RedisIndex
from kvtier.index.backends.redis_cluster import Placement, RedisClusterIndex
from kvtier.index.ingest.vllm_blocks import BlockMapper
from kvtier.index.ingest.vllm_wire import EventBatchDecoder
from kvtier.testing.redis_cluster import start_redis_cluster

FLEET_PREFILL_TOKENS_S = 8192 / 0.588  # reference-numbers.md, 8k miss row
EVENTS_PER_INSTANCE_S = 2 * FLEET_PREFILL_TOKENS_S / 16  # stored + removed 16-token blocks
CLUSTER_SHARDS = 6
COALESCED = 16  # vLLM batches in one apply: a follower behind its engine drains what queued


@contextlib.contextmanager
def redis_index(
    backend: str, url: str | None, prefix: str, shards: int = CLUSTER_SHARDS
) -> Iterator[tuple[ChunkIndex, list]]:
    """(the index, a client per master) on a given or freshly started Redis / cluster."""
    from kvtier.bench.micro.index import _start_redis

    with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{backend}-") as tmp:
        proc = cluster = None
        if backend == "redis":
            if url is None:
                proc, url = _start_redis(Path(tmp))
            index: ChunkIndex = RedisIndex(url, prefix=prefix, timeout_s=10)
            masters = [redis.Redis.from_url(url)]
        else:
            if url is None:
                cluster = start_redis_cluster(Path(tmp) / "cluster")
                url = cluster.url
            placement: Placement = "chunk" if backend == "redis-cluster-chunk" else "namespace"
            index = RedisClusterIndex(
                url, prefix=prefix, timeout_s=10, shards=shards, placement=placement
            )
            masters = _masters(url)
        try:
            index.flush()  # type: ignore[attr-defined]
            yield index, masters
        finally:
            index.flush()  # type: ignore[attr-defined]
            index.close()
            for m in masters:
                m.close()
            if proc is not None:
                proc.terminate()
                proc.wait()
            if cluster is not None:
                cluster.stop()


def _masters(url: str) -> list[redis.Redis]:
    from redis.cluster import RedisCluster

    rc = RedisCluster.from_url(url)
    out = [redis.Redis(host=n.host, port=n.port) for n in rc.get_primaries()]
    rc.close()
    return out


def query_floor(index: ChunkIndex, keys: list[bytes], n: int) -> dict[str, dict]:
    """PING and an MGET of the prompt's bitmap keys on the node serving its namespace: the
    least any Redis index does per query."""
    from kvtier.bench.micro.index import NS, _percentiles, _timed

    shard = index
    if isinstance(index, RedisClusterIndex):
        shard = index._shards[index.shard_of(NS.root_key())]
    assert isinstance(shard, RedisIndex)
    node, names = shard._r, [shard._p + b"c:" + k for k in keys]
    return {
        "floor: PING round trip": _percentiles(_timed(node.ping, n)),
        "floor: MGET of the prompt's keys": _percentiles(_timed(lambda: node.mget(names), n)),
    }


def _server_cpu_s(masters: list[redis.Redis]) -> list[float]:
    out = []
    for m in masters:
        info = m.info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


def measure_ingest(
    index: ChunkIndex, masters: list, namespaces: int, prompts: int, coalesce: int = 1
) -> dict:
    """One client thread applies every location's stream, ``coalesce`` of its vLLM batches in
    one apply (1: each batch on its own, as a follower keeping up with its engine writes
    them; more: as one that fell behind drains what queued, up to ``DRAIN`` at a time);
    returns rates and capacity."""
    from kvtier.bench.micro.index import NS, vllm_stream

    streams = []
    for i in range(namespaces):
        ns = NS.model_copy(update={"model": f"bench-{i}"})
        ns_id = index.register_namespace(ns)
        name = f"vllm-{i}"
        index.register(Registration(name, LocationKind.INSTANCE, (ns_id,)))
        index.replace(name, {Tier.GPU: {}}, epoch=1, seq=0)
        payloads, blocks = vllm_stream(max(prompts // namespaces, 1), seed=i)
        streams.append((name, BlockMapper([ns]), EventBatchDecoder(), payloads, blocks))
    blocks = sum(s[4] for s in streams)
    cpu_before = _server_cpu_s(masters)
    start = time.perf_counter()
    for first in range(0, max(len(s[3]) for s in streams), coalesce):
        for name, mapper, decoder, payloads, _ in streams:
            taken = payloads[first : first + coalesce]
            if not taken:
                continue
            for payload in taken:
                _, events, _ = decoder.decode(payload)
                mapper.feed(events)
            ops = mapper.take_ops()
            index.apply(name, ops, epoch=1, seq_from=first + 1, seq_to=first + len(taken))
    wall = time.perf_counter() - start
    cpu_after = _server_cpu_s(masters)
    spent = [after - before for after, before in zip(cpu_after, cpu_before, strict=True)]
    capacity = blocks / max(max(spent), 1e-9)  # the busiest master saturates first
    return {
        "namespaces": namespaces,
        "coalesce": coalesce,
        "blocks": blocks,
        "blocks_per_s_one_client": blocks / wall,
        "server_cpu_s_per_master": spent,
        "capacity_blocks_per_s": capacity,
        "instances_held": capacity / EVENTS_PER_INSTANCE_S,
    }


def run(
    backends: list[str], urls: dict[str, str | None], prompts: int, shards: int = CLUSTER_SHARDS
) -> list[dict[str, Any]]:
    """Ingest on each Redis backend, 1 namespace and 6 (the cluster by namespace only: one
    Redis has one master whatever the namespaces, and placed by chunk one namespace spreads),
    a batch per apply and ``COALESCED`` (what a master holds once its followers fall behind)."""
    out = []
    for backend in backends:
        for namespaces in (1, 6) if backend == "redis-cluster" else (1,):
            for coalesce in (1, COALESCED):
                with redis_index(backend, urls.get(backend), "kvtier:ingest:", shards) as (
                    index,
                    masters,
                ):
                    row = measure_ingest(index, masters, namespaces, prompts, coalesce)
                out.append({"backend": backend, "masters": len(masters), "shards": shards} | row)
    return out


def fleet_rows(memory_blocks_per_s: float) -> dict[str, float]:
    return {
        "events_per_instance_s": EVENTS_PER_INSTANCE_S,
        "memory_instances_held": memory_blocks_per_s / EVENTS_PER_INSTANCE_S,
    }
