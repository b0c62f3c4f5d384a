"""Leases that end at the store, not by their TTL, are seen by the connector.

A store that stops hearing from a client (the store frozen, or the client's heartbeat thread
starved) ends the client's session and every lease in it at once, however long their TTL.
A real store process is frozen (SIGSTOP) past its session timeout and resumed: the
connector's load taken under the old session must fail before the workers copy, and a save
whose write lease went with the session must never be sent.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.tiers import Tiers, connect

from support.helpers import StoreProcess, start_store_process

CHUNK = 64
GEOMETRY = KvGeometry(("l0",), 32, 1024, CHUNK, "t")
IDENTITY = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_size=1)


def _store(run_dir: Path, **env: str) -> Iterator[StoreProcess]:
    proc = start_store_process(run_dir, "16MiB", env=env)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def store(run_dir: Path) -> Iterator[StoreProcess]:
    yield from _store(run_dir, KVTIER_STORE__SESSION_TIMEOUT_S="1.5")


def _request(req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def _looked_up(scheduler: ConnectorScheduler, request) -> tuple[int | None, bool]:
    """vLLM's answer once the lookup (on a lookup thread: a served store) is back."""
    deadline = time.monotonic() + 10
    while (hit := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
        assert time.monotonic() < deadline
    return hit


def _freeze_past_session_timeout(store: StoreProcess, pool) -> None:
    before = pool.session_generation
    os.kill(store.proc.pid, signal.SIGSTOP)
    time.sleep(3.5)  # > 2 session timeouts without a heartbeat getting through
    os.kill(store.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while pool.session_generation == before:  # the heartbeat learns the session ended
        assert time.monotonic() < deadline, "the client never learnt its session ended"
        time.sleep(0.05)


def test_a_load_whose_session_ended_fails_before_the_copy(store: StoreProcess) -> None:
    config = ConnectorConfig(chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, verify_loads=False)
    pool = connect(StoreConfig(address=store.address))
    scheduler = ConnectorScheduler(config, GEOMETRY, IDENTITY, Tiers(pool))
    scheduler.bind_blocks(lambda req_id: (list(range(1, 65)),), 0, lambda blocks: None)
    try:
        tokens = list(range(4, 4 + 4 * CHUNK + 1))
        seed = _request("seed", tokens)
        ns_id = scheduler.resolver.namespaces(scheduler._state(seed))[0]
        with connect(StoreConfig(address=store.address)) as writer:
            import numpy as np

            chunks = [np.zeros(GEOMETRY.chunk_bytes, dtype=np.uint8)] * 4
            writer.put(ns_id, scheduler._requests["seed"].keys(0, 4, CHUNK), chunks)
        request = _request("r", tokens)
        hit = _looked_up(scheduler, request)
        assert hit[0] == 4 * CHUNK
        _freeze_past_session_timeout(store, pool)
        scheduler.update_state_after_alloc(request, (list(range(1, 17)),), hit[0])
        meta = scheduler.build_meta([("r", 0, hit[0] + 1)])
        (job,) = meta.loads
        assert job.failed == "the store ended the session its leases belonged to"
    finally:
        scheduler.shutdown()
        pool.close()


def test_a_save_whose_session_ended_is_never_sent(store: StoreProcess) -> None:
    config = ConnectorConfig(
        chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, save_wait_s=0.0, save_defer_s=60
    )
    pool = connect(StoreConfig(address=store.address))
    scheduler = ConnectorScheduler(config, GEOMETRY, IDENTITY, Tiers(pool))
    scheduler.bind_blocks(lambda req_id: (list(range(1, 65)),), 0, lambda blocks: None)
    try:
        request = _request("r", list(range(4, 4 + 4 * CHUNK + 1)))
        _looked_up(scheduler, request)
        scheduler.update_state_after_alloc(request, ([],), 0)
        # the miss was answered from the store's view, without a call: the session a save
        # belongs to is opened now (as the connector's first lease would open it)
        assert pool.store.open_own_session()
        scheduler.saves._alloc.submit(time.sleep, 0.5)  # the allocation answers late...
        meta = scheduler.build_meta([("r", 0, 4 * CHUNK)])
        assert meta.saves == []
        _freeze_past_session_timeout(store, pool)  # ...after the session ended
        sent = []
        for _ in range(50):
            sent += scheduler.build_meta([]).saves
            time.sleep(0.02)
        assert sent == []
        assert scheduler.take_stats().get("save_errors", 0) >= 1
    finally:
        scheduler.shutdown()
        pool.close()


@pytest.fixture
def capped_store(run_dir: Path) -> Iterator[StoreProcess]:
    """A store that grants read leases 2 s at most, whatever is asked (max_lease_ttl_s)."""
    yield from _store(run_dir, KVTIER_STORE__MAX_LEASE_TTL_S="2")


def test_the_granted_lease_ttl_not_the_asked_one_decides_a_load(
    capped_store: StoreProcess,
) -> None:
    """The connector asks 60 s; the store grants 2 s without an error. A load dispatched
    after the granted lease lapsed must fail, not copy chunks that are no longer pinned."""
    config = ConnectorConfig(
        chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, verify_loads=False, load_lease_ttl_s=60
    )
    pool = connect(StoreConfig(address=capped_store.address))
    scheduler = ConnectorScheduler(config, GEOMETRY, IDENTITY, Tiers(pool))
    scheduler.bind_blocks(lambda req_id: (list(range(1, 65)),), 0, lambda blocks: None)
    try:
        import numpy as np

        tokens = list(range(4, 4 + 4 * CHUNK + 1))
        ns_id = scheduler.resolver.namespaces(scheduler._state(_request("seed", tokens)))[0]
        chunks = [np.zeros(GEOMETRY.chunk_bytes, dtype=np.uint8)] * 4
        pool.put(ns_id, scheduler._requests["seed"].keys(0, 4, CHUNK), chunks)
        request = _request("r", tokens)
        hit = _looked_up(scheduler, request)
        assert hit[0] == 4 * CHUNK
        assert scheduler._requests["r"].outcome.lease_ttl_s == 2.0
        time.sleep(2.5)  # the scheduler was slow: the granted lease lapsed
        scheduler.update_state_after_alloc(request, (list(range(1, 17)),), hit[0])
        (job,) = scheduler.build_meta([("r", 0, hit[0] + 1)]).loads
        assert job.failed == "its lease lapsed (or was about to) before the copy"
    finally:
        scheduler.shutdown()
        pool.close()
