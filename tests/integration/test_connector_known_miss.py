"""A lookup that misses costs the scheduler no round trip and no lookup thread: the connector
asks the store's shared view of its chunks on vLLM's scheduler thread and answers 0 at once
(``TierResolver.known_miss``). A hit still goes to the store, which leases it; with
``store.fast_control`` off every lookup does, as before. With the node's disk as the staging
tier the view covers the store's disk files too: a chunk only on disk is no known miss (it is
staged and hit), after a restart as well (the files the store found are in its new view)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.testing.services import disk_env, store_stats
from kvtier.tiers import Tiers, connect
from kvtier.tiers.disk import DiskTier

from support.helpers import StoreProcess, start_store_process

CHUNK = 64
GEOMETRY = KvGeometry(("l0",), 32, 1024, CHUNK, "t")
IDENTITY = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_size=1)
CONFIG = ConnectorConfig(chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, verify_loads=False)


@pytest.fixture
def store(run_dir: Path) -> Iterator[StoreProcess]:
    proc = start_store_process(run_dir, "16MiB")
    try:
        yield proc
    finally:
        proc.stop()


def _request(req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def _scheduler(address: str, fast: bool, disk: bool = False) -> ConnectorScheduler:
    pool = connect(StoreConfig(address=address, fast_control=fast))
    config, tiers = CONFIG, Tiers(pool)
    if disk:
        config = CONFIG.model_copy(
            update={"tiers": ["cpu", "disk"], "min_hit_tokens": {"cpu": CHUNK, "disk": CHUNK}}
        )
        tiers.staging.append(DiskTier(pool, timeout_s=10, chunk_tokens=CHUNK))
    scheduler = ConnectorScheduler(config, GEOMETRY, IDENTITY, tiers)
    scheduler.bind_blocks(lambda req_id: (list(range(1, 65)),), 0, lambda blocks: None)
    return scheduler


def _answer(scheduler: ConnectorScheduler, request) -> tuple[tuple[int | None, bool], int]:
    """vLLM's answer once the lookup is back, and how many times vLLM had to ask."""
    asked, deadline = 0, time.monotonic() + 10
    while True:
        asked += 1
        hit = scheduler.get_num_new_matched_tokens(request, 0)
        if hit[0] is not None:
            return hit, asked
        assert time.monotonic() < deadline


def test_a_miss_is_answered_on_the_scheduler_thread_and_a_hit_by_the_store(
    store: StoreProcess,
) -> None:
    scheduler = _scheduler(store.address, fast=True)
    tokens = list(range(4, 4 + 4 * CHUNK + 1))
    try:
        # the namespace is registered by the first lookup (a round trip, on the lookup thread)
        _answer(scheduler, _request("first", list(range(9000, 9000 + 2 * CHUNK + 1))))
        lookups = store_stats(store.address, store.pid)["lookups"]  # type: ignore[index]
        hit, asked = _answer(scheduler, _request("miss", tokens))
        assert (hit, asked) == ((0, False), 1)  # answered in the first call: no thread
        stats = scheduler.take_stats()
        assert stats.get("lookups_known_miss") == 1 and stats.get("lookups") == 2
        assert store_stats(store.address, store.pid)["lookups"] == lookups  # type: ignore[index]
        # stored now: the same prompt is looked up, leased and hit
        ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
        chunks = [np.zeros(GEOMETRY.chunk_bytes, dtype=np.uint8)] * 4
        scheduler.resolver.pool.put(ns_id, scheduler._requests["seed"].keys(0, 4, CHUNK), chunks)
        hit, _ = _answer(scheduler, _request("hit", tokens))
        assert hit[0] == 4 * CHUNK
        assert scheduler.take_stats().get("lookups_known_miss", 0) == 0
    finally:
        scheduler.shutdown()
        scheduler.resolver.pool.close()


def test_without_fast_control_every_lookup_asks_the_store(store: StoreProcess) -> None:
    scheduler = _scheduler(store.address, fast=False)
    try:
        _answer(scheduler, _request("first", list(range(9000, 9000 + 2 * CHUNK + 1))))
        lookups = store_stats(store.address, store.pid)["lookups"]  # type: ignore[index]
        hit, _ = _answer(scheduler, _request("miss", list(range(4, 4 + 4 * CHUNK + 1))))
        assert hit == (0, False)
        assert scheduler.take_stats().get("lookups_known_miss", 0) == 0
        assert store_stats(store.address, store.pid)["lookups"] == lookups + 1  # type: ignore[index]
    finally:
        scheduler.shutdown()
        scheduler.resolver.pool.close()


def _lookups(store: StoreProcess) -> tuple[int, int]:
    """The store's lookups and disk stagings so far."""
    stats = store_stats(store.address, store.pid)
    return int(stats["lookups"]), int(stats["disk_staged_chunks"])  # type: ignore[arg-type]


def test_with_the_disk_tier_a_miss_on_pool_and_disk_is_known_and_a_disk_chunk_is_staged(
    run_dir: Path, tmp_path: Path
) -> None:
    env = disk_env(tmp_path / "disk")
    tokens = list(range(4, 4 + 4 * CHUNK + 1))
    store = start_store_process(run_dir, "16MiB", env=env)
    try:
        scheduler = _scheduler(store.address, fast=True, disk=True)
        try:
            _answer(scheduler, _request("first", list(range(9000, 9000 + 2 * CHUNK + 1))))
            before = _lookups(store)
            hit, asked = _answer(scheduler, _request("miss", tokens))
            assert (hit, asked) == ((0, False), 1)  # on neither: known, no call
            assert scheduler.take_stats().get("lookups_known_miss") == 1
            assert _lookups(store) == before
            # stored, spilled to disk, then let go by the pool: on disk only
            ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
            keys = scheduler._requests["seed"].keys(0, 4, CHUNK)
            pool = scheduler.resolver.pool
            pool.put(ns_id, keys, [np.full(GEOMETRY.chunk_bytes, 7, np.uint8)] * 4)
            _wait_for(lambda: _disk_chunks(store) >= 4)
            pool.delete(ns_id, keys)
            hit, _ = _answer(scheduler, _request("from-disk", tokens))
            assert hit[0] == 4 * CHUNK
            assert scheduler.take_stats().get("lookups_known_miss", 0) == 0
            assert _lookups(store)[1] == before[1] + 4  # staged from disk
        finally:
            scheduler.shutdown()
            scheduler.resolver.pool.close()
    finally:
        store.stop()
    # a new store incarnation over the same disk: the files it found are in its view
    again = start_store_process(run_dir, "16MiB", env=env)
    try:
        scheduler = _scheduler(again.address, fast=True, disk=True)
        try:
            _answer(scheduler, _request("first", list(range(9000, 9000 + 2 * CHUNK + 1))))
            hit, _ = _answer(scheduler, _request("after-restart", tokens))
            assert hit[0] == 4 * CHUNK
            assert scheduler.take_stats().get("lookups_known_miss", 0) == 0
            other = list(range(50_000, 50_000 + 4 * CHUNK + 1))
            assert _answer(scheduler, _request("other", other)) == ((0, False), 1)
        finally:
            scheduler.shutdown()
            scheduler.resolver.pool.close()
    finally:
        again.stop()


def _disk_chunks(store: StoreProcess) -> int:
    return int(store_stats(store.address, store.pid)["disk_chunks"])  # type: ignore[arg-type]


def _wait_for(condition, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_miss_the_routers_word_rules_out_elsewhere_needs_no_index_query(
    store: StoreProcess,
) -> None:
    """With the remote tier, a miss in the node's pool still asked the index (on a lookup
    thread: vLLM asks again a step later) whether another node holds the prompt. The
    router's word (``kvtier.core.engine_hint``: the best run on another node, as the index
    answered its decision) makes that query needless when no other node could extend the
    node's run: the miss is then answered in the first call. A word that leaves room for a
    remote hit, an old one, or none: the index is asked as before."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvtier.core.config.index import IndexConfig
    from kvtier.index.client import connect as connect_index
    from kvtier.tiers.remote import RemoteTier

    index = connect_index(IndexConfig())
    queries: list[int] = []
    real_query = index.query_one
    index.query_one = lambda query: queries.append(1) or real_query(query)  # type: ignore[method-assign]
    pool = connect(StoreConfig(address=store.address))
    config = CONFIG.model_copy(
        update={"tiers": ["cpu", "remote"], "min_hit_tokens": {"cpu": CHUNK, "remote": 2 * CHUNK}}
    )
    scheduler = ConnectorScheduler(
        config, GEOMETRY, IDENTITY, Tiers(pool, [RemoteTier(index, pool, 5.0)])
    )
    scheduler.bind_blocks(lambda req_id: (list(range(1, 65)),), 0, lambda blocks: None)

    def request(req_id: str, first: int, elsewhere: int | None, age_s: float = 0.0) -> Request:
        extra = None if elsewhere is None else {"kv_transfer_params": {"kvtier": {
            "elsewhere_tokens": elsewhere}}}  # fmt: skip
        params = SamplingParams(max_tokens=1, extra_args=extra)
        tokens = list(range(first, first + 4 * CHUNK + 1))
        return Request(req_id, tokens, params, None, arrival_time=time.time() - age_s)

    try:
        _answer(scheduler, request("first", 9000, None))  # registers the namespace
        scheduler.take_stats()
        asked_before = len(queries)
        # no other node holds 2 chunks (min_hit_tokens["remote"]): answered at once
        assert _answer(scheduler, request("vouched", 100, CHUNK)) == ((0, False), 1)
        stats = scheduler.take_stats()
        assert stats.get("remote_hint_skips") == 1 and stats.get("lookups_known_miss") == 1
        assert len(queries) == asked_before  # not asked
        cases = (
            ("no-word", None, 0.0),
            ("held-elsewhere", 3 * CHUNK, 0.0),  # a remote hit is possible: ask
            ("old-word", CHUNK, 30.0),  # past router_hint_max_age_s
        )
        for n, (req_id, elsewhere, age_s) in enumerate(cases):
            asked = len(queries)
            hit, _ = _answer(scheduler, request(req_id, 2000 + 300 * n, elsewhere, age_s))
            assert hit == (0, False), req_id  # nothing anywhere: a miss either way
            assert len(queries) == asked + 1, req_id
        assert scheduler.take_stats().get("remote_hint_skips", 0) == 0
    finally:
        scheduler.shutdown()
        pool.close()
        index.close()
