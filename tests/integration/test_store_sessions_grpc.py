"""``GrpcStoreClient`` runs its session by itself against a real store: it opens one with its
first lease, heartbeats it past two timeouts, re-opens it when the store ended it, and closes
it, with its leases, on close (the session state machine: tests/unit/store/test_sessions.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.tiers.cpu import CpuTier

from support.helpers import StoreProcess, start_store_process

NS = Namespace(
    model="sessions", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
)


def keys(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return prompt_keys(ns, list(range(4 * start, 4 * (start + n))))


@pytest.fixture
def store(run_dir: Path) -> Iterator[StoreProcess]:
    proc = start_store_process(run_dir, "16MiB", env={"KVTIER_STORE__SESSION_TIMEOUT_S": "1.5"})
    try:
        yield proc
    finally:
        proc.stop()


CHUNK = 1 << 20


def put(address: str, ks: list[bytes], seed: int = 0) -> tuple[bytes, list[AllocStatus]]:
    with CpuTier(GrpcStoreClient(address)) as tier:
        ns_id = tier.register_namespace(NS, CHUNK)
        with tier.allocate(ns_id, ks, CHUNK) as lease:
            for i in lease.allocated:
                lease.write(i, np.full(CHUNK, seed + i, np.uint8))
        return ns_id, list(lease.statuses)


def test_grpc_client_runs_its_session(store: StoreProcess) -> None:
    ns_id, _ = put(store.address, keys(2))
    admin = GrpcStoreClient(store.address)
    client = GrpcStoreClient(store.address)
    try:
        assert client.info().session_timeout_s == 1.5
        assert client.lookup(ns_id, keys(2)).lease_id == 0
        assert admin.stats()["sessions"] == 0  # no lease yet: no session
        lease = client.lookup(ns_id, keys(2), lease_ttl_s=300).lease_id
        assert lease and admin.stats()["sessions"] == 1
        time.sleep(4)  # > 2 timeouts: the heartbeat thread keeps the session and lease alive
        assert client.release([lease]) == [LeaseStatus.OK]
        # The store ends the session (as it would after a long pause): the client re-opens.
        first = client.open_own_session()  # the session open now (none is opened)
        assert admin.close_session(first) == 0
        lease = client.lookup(ns_id, keys(2), lease_ttl_s=300).lease_id
        assert lease and client.open_own_session() not in (0, first)
        assert admin.stats()["read_leases"] == 1
        client.close()  # ends the session, and its lease with it
        stats = admin.stats()
        assert stats["sessions"] == 0 and stats["read_leases"] == 0
        assert stats["pinned_bytes"] == 0 and stats["session_released_read"] == 1
    finally:
        client.close()
        admin.close()
