"""Following real node store processes: snapshot at start, live events, gaps, restarts,
silence, and an index restart over Redis that resumes from its cursor."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import numpy as np

from kvtier.core.chunks import Tier
from kvtier.core.config import StoreConfig
from kvtier.core.config.index import IndexConfig, StoreSource
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import LocationKind, LocationStatus, Query
from kvtier.index.server.service import EmbeddedIndex
from kvtier.tiers import connect

from support.helpers import RedisServer, StoreProcess, start_store_process
from support.vllm_fixtures import wait_for

CHUNK = 16 << 10
NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=32
)
FAST = {"probe_interval_s": 0.2, "claim_ttl_s": 0.8}


def keys_of(seed: int, n: int = 4) -> list[bytes]:
    tokens = np.arange(seed * 10_000, seed * 10_000 + n * NS.chunk_tokens, dtype=np.uint32)
    return prompt_keys(NS, tokens)


def put(address: str, keys: list[bytes]) -> None:
    with connect(StoreConfig(address=address)) as tier:
        ns_id = tier.register_namespace(NS, CHUNK)
        tier.put(ns_id, keys, [np.full(CHUNK, i, np.uint8) for i in range(len(keys))])


def cpu_run(index, keys: list[bytes], node: str = "test-node") -> int:
    try:
        holding = index.query_one(Query(NS.root_key(), keys=keys)).of(node)
    except KvtierError as exc:  # before the store's first event names the namespace
        assert exc.code is ErrorCode.UNKNOWN_NAMESPACE
        return 0
    return holding.runs.get(Tier.CPU, 0) if holding else 0


def embedded(store: StoreProcess, **kw) -> EmbeddedIndex:
    return EmbeddedIndex(IndexConfig(stores=[StoreSource(address=store.address)], **{**FAST, **kw}))


def test_snapshot_then_live_events(store_proc: StoreProcess) -> None:
    before, after = keys_of(1), keys_of(2)
    put(store_proc.address, before)  # stored before the index existed
    index = embedded(store_proc)
    try:
        wait_for(lambda: cpu_run(index, before) == 4, what="the snapshot")
        (info,) = index.locations()
        assert info.registration.kind is LocationKind.NODE
        assert info.registration.endpoints["store"] == store_proc.address
        put(store_proc.address, after)
        wait_for(lambda: cpu_run(index, after) == 4, what="a live event")
        with connect(StoreConfig(address=store_proc.address)) as tier:
            tier.store.delete(NS.root_key(), [after[1]])
            wait_for(lambda: cpu_run(index, after) == 1, what="a deletion")
            tier.store.clear()
        wait_for(lambda: cpu_run(index, before) == 0, what="a clear")
        (source,) = index.ingest.sources()
        assert source.source == "test-node" and source.resyncs == 1
        assert source.events["stored"] == 1 and source.events["removed"] == 1
    finally:
        index.close()


def test_store_restart_and_silence(run_dir: Path) -> None:
    store = start_store_process(run_dir, "16MiB")
    index = embedded(store, heartbeat_timeout_s=1.0)
    try:
        first = keys_of(3)
        put(store.address, first)
        wait_for(lambda: cpu_run(index, first) == 4, what="first epoch")
        address = store.address
        store.stop(signal.SIGKILL)  # gone: no answers, no heartbeat
        wait_for(
            lambda: index.locations()[0].status is LocationStatus.DOWN, timeout=10, what="reaped"
        )
        assert cpu_run(index, first) == 0
        port = address.rsplit(":", 1)[1]
        store = start_store_process(run_dir, "16MiB", "--grpc-port", port)  # back, empty
        second = keys_of(4)
        put(store.address, second)
        wait_for(lambda: cpu_run(index, second) == 4, timeout=15, what="re-learned")
        assert index.locations()[0].status is LocationStatus.UP
        assert cpu_run(index, first) == 0
    finally:
        index.close()
        store.stop()


def test_index_restart_resumes_from_its_cursor_or_a_snapshot(
    run_dir: Path, redis_server: RedisServer
) -> None:
    store = start_store_process(run_dir, "16MiB", env={"KVTIER_STORE__EVENT_BUFFER": "16"})
    prefix = f"t:{uuid.uuid4().hex[:8]}:"
    config = IndexConfig(
        backend="redis", redis_url=redis_server.url, redis_prefix=prefix,
        stores=[StoreSource(address=store.address)], **FAST,
    )  # fmt: skip
    try:
        first = keys_of(5)
        index = EmbeddedIndex(config)
        put(store.address, first)
        wait_for(lambda: cpu_run(index, first) == 4, what="first index")
        index.close()
        # a few events while no index runs: the next one reads them from its cursor
        second = keys_of(6)
        put(store.address, second)
        index = EmbeddedIndex(config)
        assert cpu_run(index, first) == 4  # Redis kept the answers
        wait_for(lambda: cpu_run(index, second) == 4, what="resumed from the cursor")
        (source,) = index.ingest.sources()
        assert source.resyncs == 0 and source.gaps_recovered == 0
        index.close()
        # more events than the store buffers: the next index finds a gap, takes a snapshot
        for i in range(20):
            put(store.address, keys_of(100 + i, 1))
        index = EmbeddedIndex(config)
        wait_for(lambda: cpu_run(index, keys_of(119, 1)) == 1, what="snapshot after a gap")
        (source,) = index.ingest.sources()
        assert source.gaps_recovered == 1 and source.resyncs == 1
        assert cpu_run(index, second) == 4
        index.close()
    finally:
        store.stop()
