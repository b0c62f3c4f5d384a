"""A killed engine frees its pins in seconds, not at its leases' TTL: a real store, a real
client process holding 300 s leases, SIGKILLed; its session ends, and what it pinned is
evictable again (the session state machine: tests/unit/store/test_sessions.py). The same for
the pool space a real vLLM engine holds ahead for its saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.testing.models import make_model
from kvtier.testing.services import start_store, store_stats
from kvtier.testing.vllm_driver import kvtier_transfer_config
from kvtier.testing.vllm_server import VllmServer
from kvtier.tiers.cpu import CpuTier

from support.helpers import start_store_process

NS = Namespace(
    model="sessions", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
)


def keys(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return prompt_keys(ns, list(range(4 * start, 4 * (start + n))))


CHUNK = 1 << 20


def put(address: str, ks: list[bytes], seed: int = 0) -> tuple[bytes, list[AllocStatus]]:
    with CpuTier(GrpcStoreClient(address)) as tier:
        ns_id = tier.register_namespace(NS, CHUNK)
        with tier.allocate(ns_id, ks, CHUNK) as lease:
            for i in lease.allocated:
                lease.write(i, np.full(CHUNK, seed + i, np.uint8))
        return ns_id, list(lease.statuses)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


CHILD = textwrap.dedent(
    """
    import sys, time
    from kvtier.core.keys import Namespace
    from kvtier.store.client.grpc import GrpcStoreClient

    address, ns_json, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    held = [bytes.fromhex(k) for k in sys.argv[4].split(",")]
    fresh = [bytes.fromhex(k) for k in sys.argv[5].split(",")]
    client = GrpcStoreClient(address)
    ns_id = client.register_namespace(Namespace.model_validate_json(ns_json), chunk)
    write = client.allocate(ns_id, fresh, [chunk] * len(fresh), ttl_s=300)
    # the engine's own pin when the store keeps a lease region (the allocation got it a row)
    read = client.lookup(ns_id, held, lease_ttl_s=300)
    assert len(read.hits) == len(held) and write.lease_id
    print("leased", flush=True)
    time.sleep(600)
    """
)


def start_leasing_child(address: str, held: list[bytes], fresh: list[bytes]) -> subprocess.Popen:
    """A client process that read-leases ``held`` and write-leases ``fresh``, then sleeps."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            address,
            NS.model_dump_json(),
            str(CHUNK),
            ",".join(k.hex() for k in held),
            ",".join(k.hex() for k in fresh),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "leased"
    return child


def test_killed_client_frees_its_pins_in_seconds(run_dir: Path) -> None:
    """The drill: an engine holding 300 s leases is SIGKILLed; its pins go within seconds
    (store.session_timeout_s, default 5 s), and what they pinned is evictable again. Store
    leases here (``store.view_leases`` off); the engine's own pins: the test below."""
    store = start_store_process(
        run_dir,
        "16MiB",
        env={"KVTIER_STORE__POOL__EVICTION": "lru", "KVTIER_STORE__VIEW_LEASES": "false"},
    )
    admin = GrpcStoreClient(store.address)
    child = None
    try:
        pinned = keys(4)
        ns_id, statuses = put(store.address, pinned)
        assert statuses == [AllocStatus.ALLOCATED] * 4
        fresh = keys(1, start=100)
        child = start_leasing_child(store.address, pinned, fresh)
        stats = admin.stats()
        assert stats["read_leases"] == 1 and stats["write_leases"] == 1
        assert stats["pinned_bytes"] == 4 * CHUNK and stats["sessions"] == 1
        # While the client lives its chunks are pinned: a flood of puts cannot evict them.
        flood = keys(16, start=200)
        for i in range(0, 16, 4):
            put(store.address, flood[i : i + 4], seed=i)
        assert len(admin.lookup(ns_id, pinned).hits) == 4  # (LRU: now the most recent)

        child.send_signal(signal.SIGKILL)
        child.wait(10)
        took = wait_for(
            lambda: admin.stats()["read_leases"] == 0 and admin.stats()["write_leases"] == 0,
            60,
            "the killed client's leases to end",
        )
        assert took < 60  # well under the 300 s TTL
        stats = admin.stats()
        assert stats["pinned_bytes"] == 0 and stats["writing_bytes"] == 0
        assert stats["sessions"] == 0 and stats["sessions_expired"] == 1
        assert stats["session_released_read"] == 1 and stats["session_released_write"] == 1
        assert stats["expired_read"] == 0  # ended with the session, not by TTL

        # The chunks it pinned are evictable again: a flood the size of the pool takes them.
        more = keys(16, start=400)
        for i in range(0, 16, 4):
            _, statuses = put(store.address, more[i : i + 4], seed=i)
            assert statuses == [AllocStatus.ALLOCATED] * 4
        assert admin.lookup(ns_id, pinned).hits == []
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        admin.close()
        store.stop()


def test_killed_engine_frees_the_pins_it_took_itself(run_dir: Path) -> None:
    """The same drill with the engine's own read leases (pins in the store's shared lease
    region, ``kvtier.store.client.view_leases``): they hold against a flood while it lives,
    and its session's end takes them, so the pages they held are the pool's again."""
    # a 1 s session timeout: the drill waits for the session to end, not for its default 5 s
    env = {"KVTIER_STORE__POOL__EVICTION": "lru", "KVTIER_STORE__SESSION_TIMEOUT_S": "1"}
    store = start_store_process(run_dir, "16MiB", env=env)
    admin = GrpcStoreClient(store.address)
    child = None
    try:
        pinned = keys(4)
        ns_id, statuses = put(store.address, pinned)
        assert statuses == [AllocStatus.ALLOCATED] * 4
        fresh = keys(1, start=100)
        child = start_leasing_child(store.address, pinned, fresh)
        stats = admin.stats()
        assert stats["view_pinned_chunks"] == 4 and stats["read_leases"] == 0
        assert stats["write_leases"] == 1 and stats["sessions"] == 1
        # two floods the size of the pool: the pinned chunks end up the coldest and stay
        flood = keys(32, start=200)
        for i in range(0, 32, 4):
            put(store.address, flood[i : i + 4], seed=i)
        assert len(admin.lookup(ns_id, pinned).hits) == 4

        child.send_signal(signal.SIGKILL)
        child.wait(10)
        took = wait_for(
            lambda: admin.stats()["view_pinned_chunks"] == 0 and admin.stats()["sessions"] == 0,
            60,
            "the killed engine's session to end",
        )
        assert took < 60  # well under the 300 s TTL it asked for
        assert admin.stats()["sessions_expired"] == 1
        more = keys(16, start=400)
        for i in range(0, 16, 4):
            _, statuses = put(store.address, more[i : i + 4], seed=i)
            assert statuses == [AllocStatus.ALLOCATED] * 4
        assert admin.lookup(ns_id, pinned).hits == []
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        admin.close()
        store.stop()


@pytest.mark.vllm
def test_killed_engine_frees_the_pool_space_it_held_for_saves(run_dir: Path) -> None:
    """A real vLLM engine holding pool space ahead for its saves (``save_held_chunks``:
    placeholders under a write lease of its session, ``connector/save_slab.py``) is
    SIGKILLed with the whole of its process group: the store ends its session within seconds,
    long before the write leases' TTL, quarantines the held pages (a write the store did not
    see end may still land: ``ended_write_quarantine_s``, 30 s) and then frees every one."""
    # a 1 s session timeout: the drill waits for the session to end, not for its default 5 s
    env = {"KVTIER_STORE__SESSION_TIMEOUT_S": "1", "KVTIER_STORE__WRITE_TTL_S": "120"}
    store = start_store(run_dir / "store", "64MiB", "held-drill", remote=False, env=env)
    extra = {"store_address": store.address, "chunk_tokens": 64, "save_held_chunks": 8}
    server = VllmServer(
        make_model(run_dir / "model"),
        run_dir / "vllm.log",
        extra_args=["--kv-transfer-config", json.dumps(kvtier_transfer_config(extra))],
        env={"KVTIER_STORE__RUN_DIR": str(run_dir / "store")},
    )

    def stats() -> dict:
        got = store_stats(store.address, store.pid)
        assert got is not None, "the store exited"
        return got

    try:
        server.wait_ready()
        server.complete(list(range(10, 310)))  # a miss: its 4 chunks saved, the slab noted
        wait_for(lambda: stats()["writing_bytes"] > 0, 60, "the engine to hold pool space")
        held = stats()
        assert held["sessions"] >= 1 and held["write_leases"] >= 1, held
        assert held["chunks"] >= 4, held  # the prompt's saves committed beside the held space

        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        took = wait_for(
            lambda: (s := stats())["writing_bytes"] == 0 and s["sessions"] == 0,
            60,
            "the killed engine's held pool space to be freed",
        )
        assert took < 60  # by the session's end, not the write leases' 120 s TTL
        ended = stats()
        assert ended["write_leases"] == 0 and ended["sessions_expired"] >= 1, ended
        assert ended["quarantined_bytes"] == held["writing_bytes"], (held, ended)
        wait_for(
            lambda: stats()["free_bytes"] == held["free_bytes"] + held["writing_bytes"],
            90,
            "the quarantined pages to be free again",
        )
        assert stats()["quarantined_bytes"] == 0
    finally:
        server.stop()
        store.stop()
