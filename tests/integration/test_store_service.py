"""The store as a real process: clients in other processes share its pool over shared memory."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.events import EventGap, EventKind
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.client.shm import segment_exists
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc
from kvtier.testing.ports import free_port
from kvtier.tiers import connect

from support.helpers import (
    StoreProcess,
    child_get,
    child_lease_and_die,
    child_put,
    chunk_bytes,
    start_store_process,
)

CHUNK = 256 << 10
SPAWN = mp.get_context("spawn")


def in_child(fn, *args):
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_chunks_put_by_one_process_are_read_by_another(
    store_proc: StoreProcess, namespace: Namespace
) -> None:
    ns_json = namespace.model_dump_json()
    keys = in_child(child_put, store_proc.address, ns_json, CHUNK, 8, 3)
    got = in_child(child_get, store_proc.address, ns_json, CHUNK, keys)
    assert len(got) == 8
    for i, data in enumerate(got):
        assert data == chunk_bytes(3 * 1000 + i, CHUNK).tobytes()
    # and this (third) process sees them too, through its own mapping of the segment
    with connect(StoreConfig(address=store_proc.address)) as tier:
        ns_id = tier.register_namespace(namespace, CHUNK)
        assert tier.prefix_length(ns_id, [bytes.fromhex(k) for k in keys]) == 8


def test_health_ready_metrics_stats(store_proc: StoreProcess, namespace: Namespace) -> None:
    in_child(child_put, store_proc.address, namespace.model_dump_json(), CHUNK, 4, 1)
    assert http_get(f"{store_proc.http}/healthz")[0] == 200
    status, body = http_get(f"{store_proc.http}/readyz")
    assert status == 200 and json.loads(body)["status"] == "ready"
    status, metrics = http_get(f"{store_proc.http}/metrics")
    assert status == 200
    assert "kvtier_store_capacity_bytes 1.6777216e+07" in metrics
    assert 'kvtier_store_op_seconds_count{op="allocate"} 1.0' in metrics
    assert 'kvtier_store_op_seconds_count{op="commit"} 1.0' in metrics
    assert "kvtier_store_chunks 4.0" in metrics
    for name in ("evictions_total", "read_leases", "write_leases", "pinned_bytes"):
        assert f"kvtier_store_{name}" in metrics
    status, body = http_get(f"{store_proc.http}/stats")
    stats = json.loads(body)
    assert stats["chunks"] == 4 and stats["node_id"] == "test-node"


def test_cli_stats(store_proc: StoreProcess) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "store",
            "stats",
            "--address",
            store_proc.address,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["capacity_bytes"] == 16 << 20


def test_bad_input_over_grpc(store_proc: StoreProcess, namespace: Namespace) -> None:
    client = GrpcStoreClient(store_proc.address)
    ns_id = client.register_namespace(namespace, CHUNK)
    keys = prompt_keys(namespace, list(range(64)))
    cases = [
        (lambda: client.lookup(b"\1" * 16, keys), ErrorCode.UNKNOWN_NAMESPACE),
        (lambda: client.allocate(ns_id, keys, [CHUNK - 1] * 2), ErrorCode.WRONG_SIZE),
        (lambda: client.commit(999, None, []), ErrorCode.UNKNOWN_LEASE),
        (lambda: client.register_namespace(namespace, CHUNK * 2), ErrorCode.NAMESPACE_MISMATCH),
    ]
    for call, code in cases:
        with pytest.raises(KvtierError) as err:
            call()
        assert err.value.code is code, err.value
    # malformed requests straight on the wire
    stub = store_pb2_grpc.StoreStub(grpc.insecure_channel(store_proc.address))
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Lookup(pb.LookupRequest(ns_id=ns_id, keys=b"x" * 15))
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ("kvtier-error-code", "INVALID_ARGUMENT") in rpc.value.trailing_metadata()
    with pytest.raises(grpc.RpcError) as rpc:
        stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(namespace_json="{not json", chunk_bytes=1)
        )
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as rpc:
        stub.Lookup(pb.LookupRequest(epoch=12345, ns_id=ns_id, keys=keys[0]))
    assert ("kvtier-error-code", "STALE_EPOCH") in rpc.value.trailing_metadata()
    # the store is still fine
    assert client.lookup(ns_id, keys).stop is LookupStatus.MISS
    client.close()


def test_full_pool_of_pinned_chunks(store_proc: StoreProcess, namespace: Namespace) -> None:
    with connect(StoreConfig(address=store_proc.address)) as tier:
        ns_id = tier.register_namespace(namespace, 1 << 20)
        keys = prompt_keys(namespace, list(range(32 * 16)))  # 16 x 1 MiB fills 16 MiB
        data = [chunk_bytes(i, 1 << 20) for i in range(16)]
        assert tier.put(ns_id, keys, data).stored == 16
        with tier.read(ns_id, keys) as lease:
            more = prompt_keys(namespace, list(range(10_000, 10_000 + 64)))
            result = tier.put(ns_id, more, [chunk_bytes(99, 1 << 20)] * 2)
            assert (result.stored, result.skipped) == (0, 2)
            assert [lease.read(i) for i in range(16)] == [d.tobytes() for d in data]
        assert lease.valid
        assert tier.put(ns_id, more, [chunk_bytes(99, 1 << 20)] * 2).stored == 2


def test_events_stream_and_snapshot(run_dir: Path, namespace: Namespace) -> None:
    proc = start_store_process(run_dir, "16MiB")
    try:
        client = GrpcStoreClient(proc.address)
        keys = [
            bytes.fromhex(k)
            for k in in_child(child_put, proc.address, namespace.model_dump_json(), CHUNK, 3, 5)
        ]
        batches = client.read_events(1)
        assert isinstance(batches, list)
        stored = [e for b in batches for e in b.events if e.kind is EventKind.STORED]
        assert [k for e in stored for k in e.keys] == keys
        assert all(b.node_id == "test-node" and b.epoch == client.epoch for b in batches)
        # a long-polling reader (what the index does) sees new events as they happen
        ns_id = client.register_namespace(namespace, CHUNK)
        client.delete(ns_id, keys[:1])
        later = client.read_events(batches[-1].seq + 1, timeout=5)
        assert isinstance(later, list)
        batch = later[0]
        assert batch.events[0].kind is EventKind.REMOVED and batch.events[0].keys == (keys[0],)
        snap = client.snapshot()
        assert snap.seq == batch.seq and snap.chunks == {ns_id: keys[1:]}
        client.close()
    finally:
        proc.stop()


def test_event_gap_is_reported(run_dir: Path, namespace: Namespace) -> None:
    proc = start_store_process(run_dir, "16MiB", env={"KVTIER_STORE__EVENT_BUFFER": "16"})
    try:
        with connect(StoreConfig(address=proc.address)) as tier:
            ns_id = tier.register_namespace(namespace, CHUNK)
            for i in range(20):
                tier.put(
                    ns_id,
                    prompt_keys(namespace, list(range(i * 32, i * 32 + 32))),
                    [chunk_bytes(i, CHUNK)],
                )
            got = tier.store.read_events(1)
            assert isinstance(got, EventGap) and got.oldest == 5
            snap = tier.store.snapshot()
            assert snap.seq == 20 and len(snap.chunks[ns_id]) == 20
    finally:
        proc.stop()


def test_dead_reader_leaks_nothing(run_dir: Path, namespace: Namespace) -> None:
    """A store lease's TTL ends it (store.view_leases off: with it the engine pins hits
    itself, and its session ends them: tests/drills/test_killed_client.py)."""
    proc = start_store_process(run_dir, "16MiB", env={"KVTIER_STORE__VIEW_LEASES": "false"})
    try:
        ns_json = namespace.model_dump_json()
        keys = in_child(child_put, proc.address, ns_json, CHUNK, 4, 2)
        child = SPAWN.Process(
            target=child_lease_and_die, args=(proc.address, ns_json, CHUNK, keys, 1.0)
        )
        child.start()
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        client = GrpcStoreClient(proc.address)
        deadline = time.monotonic() + 10
        while client.stats()["read_leases"] and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert stats["read_leases"] == 0 and stats["pinned_bytes"] == 0
        assert stats["expired_read"] == 1
        client.close()
    finally:
        proc.stop()


def test_clean_shutdown_releases_shared_memory(run_dir: Path) -> None:
    proc = start_store_process(run_dir, "16MiB")
    assert segment_exists(proc.segment)
    assert proc.stop(signal.SIGTERM) == 0
    assert not segment_exists(proc.segment)
    assert list(run_dir.iterdir()) == []


def _wait_removed(segment: str, run_dir: Path) -> None:
    """The watchdog unlinks the segment, then the lock file: wait for both, not just the first."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (segment_exists(segment) or any(run_dir.iterdir())):
        time.sleep(0.05)
    assert not segment_exists(segment)
    assert list(run_dir.iterdir()) == []


def test_crash_leaves_no_segment_behind(run_dir: Path) -> None:
    """SIGKILL runs no cleanup in the store; its watchdog removes the segment and lock file."""
    crashed = start_store_process(run_dir, "16MiB")
    assert segment_exists(crashed.segment)
    crashed.stop(signal.SIGKILL)
    _wait_removed(crashed.segment, run_dir)


def _watchdogs(segment: str) -> list[psutil.Process]:
    """The processes watching ``segment`` (its path is in their arguments)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(segment in arg for arg in p.info["cmdline"] or []):
            found.append(p)
    return found


def test_crash_of_the_whole_process_tree_leaves_no_segment_behind(run_dir: Path) -> None:
    """A supervisor that SIGKILLs the store's process and every descendant (vLLM's shutdown does
    this to its engine process, where an embedded store lives) does not reach the watchdog:
    it is not a descendant, and it removes the segment and lock file."""
    crashed = start_store_process(run_dir, "16MiB")
    assert _watchdogs(crashed.segment), "no watchdog"
    tree = [psutil.Process(crashed.proc.pid), *psutil.Process(crashed.proc.pid).children(True)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=5)
    _wait_removed(crashed.segment, run_dir)


def test_restart_after_crash_cleans_up(run_dir: Path) -> None:
    """Even with its watchdog gone too (the whole node's processes killed), the next store on
    the node removes what a crashed one left."""
    crashed = start_store_process(run_dir, "16MiB")
    lock = next(run_dir.glob("*.lock"))
    watchdogs = _watchdogs(crashed.segment)
    assert watchdogs
    for child in watchdogs:
        child.kill()
    psutil.wait_procs(watchdogs, timeout=5)
    crashed.stop(signal.SIGKILL)
    assert segment_exists(crashed.segment) and lock.exists()  # the crash left them behind
    fresh = start_store_process(run_dir, "16MiB")
    try:
        assert not segment_exists(crashed.segment)  # the next store on the node removed it
        assert segment_exists(fresh.segment)
    finally:
        fresh.stop()


def test_client_survives_store_restart(run_dir: Path, namespace: Namespace) -> None:
    port = str(free_port())
    first = start_store_process(run_dir, "16MiB", "--grpc-port", port)
    tier = connect(StoreConfig(address=first.address))
    try:
        ns_id = tier.register_namespace(namespace, CHUNK)
        keys = prompt_keys(namespace, list(range(64)))
        tier.put(ns_id, keys, [chunk_bytes(1, CHUNK), chunk_bytes(2, CHUNK)])
        first.stop()
        second = start_store_process(run_dir, "16MiB", "--grpc-port", port)
        try:
            # the old epoch's offsets are refused; the tier re-attaches to the new segment
            # (once gRPC's channel has left the backoff its first failure put it in: a slow
            # host restarts the store within it, and calls fail fast UNAVAILABLE until then)
            assert _after_reconnect(lambda: tier.prefix_length(ns_id, keys)) == 0
            assert tier.info.epoch == GrpcStoreClient(second.address).epoch
            tier.put(ns_id, keys, [chunk_bytes(3, CHUNK), chunk_bytes(4, CHUNK)])
            assert tier.get(ns_id, keys)[1] == chunk_bytes(4, CHUNK).tobytes()
        finally:
            second.stop()
        with pytest.raises(KvtierError) as err:
            tier.prefix_length(ns_id, keys)
        assert err.value.code is ErrorCode.UNAVAILABLE
    finally:
        tier.close()


def test_pipelined_put_and_get_streams(store_proc: StoreProcess, namespace: Namespace) -> None:
    """put_stream/get_stream_into overlap control calls with copies; bytes still exact, and a
    missing chunk ends the prefix."""
    with connect(StoreConfig(address=store_proc.address)) as tier:
        ns_id = tier.register_namespace(namespace, CHUNK)
        keys = prompt_keys(namespace, list(range(32 * 24)))
        data = [chunk_bytes(100 + i, CHUNK) for i in range(24)]
        result = tier.put_stream(ns_id, keys, data, batch_bytes=5 * CHUNK)
        assert (result.stored, result.existed) == (24, 0)
        assert tier.put_stream(ns_id, keys, data, batch_bytes=5 * CHUNK).existed == 24
        dsts = [bytearray(CHUNK) for _ in keys]
        assert tier.get_stream_into(ns_id, keys, dsts, batch_bytes=7 * CHUNK) == 24
        assert all(bytes(d) == x.tobytes() for d, x in zip(dsts, data, strict=True))
        tier.store.delete(ns_id, [keys[10]])
        assert tier.get_stream_into(ns_id, keys, dsts, batch_bytes=7 * CHUNK) == 10
        assert tier.store.stats()["read_leases"] == 0


def _after_reconnect(call, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    """``call()`` once the client reaches the store again (UNAVAILABLE meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except KvtierError as exc:
            if exc.code is not ErrorCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
