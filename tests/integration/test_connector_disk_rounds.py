"""A disk hit longer than one stage may allocate is staged whole, in rounds, and a stage
never evicts the chunks of its own run that are already in the pool.

The node store stages at most ``store.max_batch_fraction`` of its pool per call (one
allocation: a quarter by default), so that no single call flushes the pool. With that
default, a prompt whose run on disk was longer than the quarter was cut there and its tail
recomputed. The connector now asks again for the rest, leasing each round before the next
one allocates (``TierResolver._stage_rounds``): through a real store process with its disk
tier, a run of 1.5x that share hits whole.

The second cut was the one docs/disk.md's 32k row saw: a prompt's later chunks still in the
pool are its coldest (and, once on disk, eviction's first choice), so the allocation that
staged the earlier ones evicted them; a write-back pool's tail not yet on disk was lost and
the hit ended there. A stage now pins the run's chunks already in the pool while it allocates.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.testing.services import disk_env, store_stats
from kvtier.tiers import Tiers, connect
from kvtier.tiers.disk import DiskTier

from support.helpers import start_store_process

CHUNK = 64
GEOMETRY = KvGeometry(("l0",), 32, 1024, CHUNK, "t")  # 64 KiB chunks
IDENTITY = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_size=1)
CONFIG = ConnectorConfig(
    chunk_tokens=CHUNK,
    tiers=["cpu", "disk"],
    min_hit_tokens={"cpu": CHUNK, "disk": CHUNK},
    verify_loads=False,
)
POOL = 16 << 20  # 256 chunks: one stage allocates at most 64 (the default quarter)
CHUNKS = 96


def _request(req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def test_a_run_longer_than_one_stage_is_staged_whole(run_dir: Path, tmp_path: Path) -> None:
    store = start_store_process(run_dir, "16MiB", env=disk_env(tmp_path / "disk"))
    pool = connect(StoreConfig(address=store.address))
    tiers = Tiers(pool)
    tiers.staging.append(DiskTier(pool, timeout_s=10, chunk_tokens=CHUNK))
    scheduler = ConnectorScheduler(CONFIG, GEOMETRY, IDENTITY, tiers)
    scheduler.bind_blocks(lambda req_id: (list(range(1, 2 * CHUNKS + 1)),), 0, lambda b: None)
    tokens = list(range(4, 4 + CHUNKS * CHUNK + 1))
    try:
        # stored, written through to disk, then let go by the pool: on disk only
        ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
        keys = scheduler._requests["seed"].keys(0, CHUNKS, CHUNK)
        for i in range(0, CHUNKS, 32):  # each put within the quarter of the pool
            pool.put(ns_id, keys[i : i + 32], [np.full(GEOMETRY.chunk_bytes, 7, np.uint8)] * 32)
        _wait_for(lambda: _stats(store)["disk_chunks"] >= CHUNKS)
        pool.delete(ns_id, keys)
        calls = _stats(store)["disk_stage_calls"]

        request = _request("from-disk", tokens)
        deadline = time.monotonic() + 20
        while (hit := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        assert hit[0] == CHUNKS * CHUNK  # the whole run, not the 64 chunks of one stage
        stats = _stats(store)
        assert stats["disk_staged_chunks"] == CHUNKS
        assert stats["disk_stage_calls"] - calls == 2  # 64, then the other 32
    finally:
        scheduler.shutdown()
        pool.close()
        store.stop()


def test_a_stage_never_evicts_its_own_runs_chunks(run_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    tokens = list(range(4, 4 + CHUNKS * CHUNK + 1))
    head = 64  # one stage's share of the pool

    # a first store writes the run's head through to disk and is stopped
    first = start_store_process(run_dir, "16MiB", env=disk_env(disk))
    scheduler, pool = _scheduler(first.address)
    try:
        ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
        keys = scheduler._requests["seed"].keys(0, CHUNKS, CHUNK)
        for i in range(0, head, 32):
            pool.put(ns_id, keys[i : i + 32], [np.full(GEOMETRY.chunk_bytes, 7, np.uint8)] * 32)
        _wait_for(lambda: _stats(first)["disk_chunks"] >= head)
    finally:
        scheduler.shutdown()
        pool.close()
        first.stop()

    # a write-back store that copies nothing (high watermark 1) finds the head on disk; the
    # run's tail is in its pool only, put first (the coldest), then other chunks up to 232 of
    # its 256: staging the head must evict 40
    env = disk_env(
        disk,
        KVTIER_STORE__DISK__WRITE_THROUGH="false",
        KVTIER_STORE__DISK__HIGH_WATERMARK="1",
    )
    second = start_store_process(run_dir, "16MiB", env=env)
    scheduler, pool = _scheduler(second.address)
    try:
        ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
        keys = scheduler._requests["seed"].keys(0, CHUNKS, CHUNK)
        other = list(range(1 << 20, (1 << 20) + 200 * CHUNK + 1))  # shares no chunk
        scheduler.resolver.namespaces(scheduler._state(_request("other", other)))
        other_keys = scheduler._requests["other"].keys(0, 200, CHUNK)
        chunk = [np.full(GEOMETRY.chunk_bytes, 9, np.uint8)] * 40
        for batch in (keys[head:], *(other_keys[i : i + 40] for i in range(0, 200, 40))):
            pool.put(ns_id, batch, chunk[: len(batch)])
        assert _stats(second)["disk_chunks"] == head  # nothing of the tail was copied

        request = _request("from-disk", tokens)
        deadline = time.monotonic() + 20
        while (hit := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        stats = _stats(second)
        assert hit[0] == CHUNKS * CHUNK, stats  # the head from disk, the tail still in DRAM
        assert stats["disk_staged_chunks"] == head
    finally:
        scheduler.shutdown()
        pool.close()
        second.stop()


def _scheduler(address: str) -> tuple[ConnectorScheduler, Any]:
    pool = connect(StoreConfig(address=address))
    tiers = Tiers(pool)
    tiers.staging.append(DiskTier(pool, timeout_s=10, chunk_tokens=CHUNK))
    scheduler = ConnectorScheduler(CONFIG, GEOMETRY, IDENTITY, tiers)
    scheduler.bind_blocks(lambda req_id: (list(range(1, 2 * CHUNKS + 1)),), 0, lambda b: None)
    return scheduler, pool


def _stats(store) -> dict[str, float]:
    found = store_stats(store.address, store.pid)
    return {k: float(v) for k, v in found.items() if isinstance(v, int | float)}


def _wait_for(condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)
