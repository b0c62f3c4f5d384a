"""The disk tier of a real store process, over gRPC: chunks another process stored come back
from disk once the pool let them go, after a ``kill -9`` too, with the metrics and the events
that say so (the embedded cases and every bad-file path: tests/unit/store/test_disk.py)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.events import EventBatch
from kvtier.store.api.remote import FetchStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.disk.files import HEADER_BYTES
from kvtier.testing.services import disk_env
from kvtier.tiers import connect

from support.helpers import StoreProcess, start_store_process

CHUNK = 64 << 10


def disk_store(run_dir: Path, disk: Path) -> StoreProcess:
    return start_store_process(run_dir, "4MiB", env=disk_env(disk))


def wait_on_disk(store: StoreProcess, chunks: int) -> None:
    """Until the store's stats count ``chunks`` on disk (the spill thread runs every 50 ms),
    for as long as the store runs."""
    while store.proc.poll() is None:
        with urllib.request.urlopen(f"{store.http}/stats", timeout=10) as resp:
            if json.loads(resp.read())["disk_chunks"] >= chunks:
                return
        time.sleep(0.05)
    raise AssertionError("the store exited")


def test_chunks_come_back_from_disk_through_the_store_and_after_a_crash(
    run_dir: Path, tmp_path: Path, namespace: Namespace
) -> None:
    disk = tmp_path / "disk"
    keys = prompt_keys(namespace, list(range(4 * namespace.chunk_tokens)))
    data = [np.random.default_rng(i).integers(0, 256, CHUNK, np.uint8).tobytes() for i in range(4)]
    store = disk_store(run_dir, disk)
    try:
        with connect(StoreConfig(address=store.address)) as tier:
            ns_id = tier.namespace_id(namespace, CHUNK)
            tier.put(ns_id, keys, data)
            wait_on_disk(store, 4)
            tier.delete(ns_id, keys)  # the pool lets them go; the disk keeps them
            result = tier.stage_from_disk(ns_id, keys, timeout_s=10)
            assert (result.status, result.local, result.fetched) == (FetchStatus.OK, 4, 4)
            lease = tier.read(ns_id, keys)
            assert [lease.read(i) for i in range(4)] == data
            assert lease.release()
        with urllib.request.urlopen(f"{store.http}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert "kvtier_store_disk_chunks 4.0" in metrics
        assert "kvtier_store_disk_staged_chunks_total 4.0" in metrics
        assert "kvtier_store_disk_stage_seconds_count 1.0" in metrics
        # one observation per chunk file written and per file read back (the stage's four)
        assert 'kvtier_store_disk_file_seconds_count{op="write"} 4.0' in metrics
        assert 'kvtier_store_disk_file_seconds_count{op="read"} 4.0' in metrics
        # the unsalted namespace is an unlisted tenant: its files counted as "other"
        file_bytes = 4 * (CHUNK + HEADER_BYTES)
        assert f'kvtier_store_disk_tenant_used_bytes{{tenant="other"}} {file_bytes:.1f}' in metrics
        admin = GrpcStoreClient(store.address)
        try:
            batches = admin.read_events(1, timeout=1)
            assert isinstance(batches, list)
            disk_events = [
                (e.kind.value, len(e.keys))
                for b in batches
                if isinstance(b, EventBatch)
                for e in b.events
                if e.tier == "disk"
            ]
            assert {kind for kind, _ in disk_events} == {"stored"}
            assert sum(n for _, n in disk_events) == 4  # in one spill round or several
            assert admin.snapshot().disk_chunks == {ns_id: keys}
        finally:
            admin.close()
        store.proc.send_signal(signal.SIGKILL)
        store.proc.wait(timeout=30)
    finally:
        store.stop()
    again = disk_store(run_dir, disk)
    try:
        with connect(StoreConfig(address=again.address)) as tier:
            ns_id = tier.namespace_id(namespace, CHUNK)
            assert tier.prefix_length(ns_id, keys) == 0  # a new pool: empty
            result = tier.stage_from_disk(ns_id, keys, timeout_s=10)
            assert (result.status, result.local) == (FetchStatus.OK, 4)
            lease = tier.read(ns_id, keys)
            assert [lease.read(i) for i in range(4)] == data
            assert lease.release()
    finally:
        again.stop()
