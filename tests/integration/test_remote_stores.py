"""The remote tier with real store processes talking over the real Mooncake transfer engine
(TCP on loopback): fetches byte-exact between 2 and 3 stores, partial results, corruption,
a holder killed or frozen mid-transfer, and demotion to a peer with room.

Budget: ~1.5 s per store process; the fault tests wait out one quarantine (6 s)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.events import EventKind
from kvtier.store.api.remote import FetchStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.client.shm import SharedSegment, checksum_views
from kvtier.store.run_dir import cleanup_stale_segments
from kvtier.testing.ports import free_port
from kvtier.tiers.cpu import CpuTier

from support.helpers import StoreProcess, start_store_process

pytestmark = pytest.mark.remote

MiB = 1 << 20
QUARANTINE_S = 6.0
REMOTE_ENV = {
    "KVTIER_STORE__REMOTE__FETCH_TIMEOUT_S": "1.5",
    "KVTIER_STORE__REMOTE__QUARANTINE_S": str(QUARANTINE_S),
}
NS = Namespace(model="remote-test", dtype="f16", num_layers=2, num_kv_heads=2, head_size=64)
_BLOCK = np.random.default_rng(7).integers(0, 256, 64 << 10, dtype=np.uint8)


def chunk(seed: int, size: int) -> np.ndarray:
    """Distinct bytes per seed, cheap to make at any size."""
    data = np.resize(_BLOCK, size)
    data ^= np.uint8(seed % 251 + 1)
    data[:8] = np.frombuffer(int(seed).to_bytes(8, "little"), np.uint8)
    return data


def remote_store(run_dir: Path, capacity: str, node_id: str, *extra: str, **env: str):
    return start_store_process(
        run_dir, capacity, "--remote", *extra, node_id=node_id, env={**REMOTE_ENV, **env}
    )


def peer_ports(n: int) -> list[str]:
    """Free ports for stores that must know each other before they start: a store fetches
    only from its peers (``--peers``) and the node stores the index lists."""
    return [str(free_port()) for _ in range(n)]


def on(port: str, *peers: str) -> tuple[str, ...]:
    """Arguments for a store at ``port`` whose peers are the stores at ``peers``."""
    listed = ",".join(f"127.0.0.1:{p}" for p in peers)
    return ("--grpc-port", port, *(("--peers", listed) if peers else ()))


def put(store: StoreProcess, ns: Namespace, size: int, seeds: range) -> tuple[bytes, list[bytes]]:
    """Put chunks with the given seeds (token runs start at seed * chunk_tokens)."""
    keys = keys_for(ns, seeds)
    with CpuTier(GrpcStoreClient(store.address)) as tier:
        ns_id = tier.register_namespace(ns, size)
        result = tier.put(ns_id, keys, [chunk(s, size) for s in seeds])
        assert result.stored + result.existed == len(keys)
    return ns_id, keys


def keys_for(ns: Namespace, seeds: range) -> list[bytes]:
    tokens = np.arange(0, seeds.stop * ns.chunk_tokens, dtype=np.uint32)
    return prompt_keys(ns, tokens)[seeds.start : seeds.stop]


def assert_holds(store: StoreProcess, ns: Namespace, size: int, keys, seeds) -> None:
    with CpuTier(GrpcStoreClient(store.address)) as tier:
        ns_id = tier.register_namespace(ns, size)
        got = tier.get(ns_id, keys)
    assert len(got) == len(keys)
    for data, seed in zip(got, seeds, strict=True):
        assert data == chunk(seed, size).tobytes()


def client(store: StoreProcess, ns: Namespace, size: int) -> tuple[GrpcStoreClient, bytes]:
    c = GrpcStoreClient(store.address)
    return c, c.register_namespace(ns, size)


def stored_keys(c: GrpcStoreClient, kind: EventKind) -> set[bytes]:
    batches = c.read_events(1)
    assert isinstance(batches, list)
    return {k for b in batches for e in b.events if e.kind is kind for k in e.keys}


def scrape(store: StoreProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"{store.http}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in lines if not line.startswith("#"))
    }


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_no_leak(c: GrpcStoreClient) -> None:
    stats = c.stats()
    assert stats["write_leases"] == 0 and stats["writing_bytes"] == 0
    assert stats["read_leases"] == 0
    assert stats["used_bytes"] == stats["committed_bytes"] + stats["quarantined_bytes"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StoreProcess, ...]]:
    run_dir = tmp_path_factory.mktemp("run")
    pa, pb = peer_ports(2)
    a = remote_store(run_dir, "64MiB", "node-a", *on(pa, pb))
    b = remote_store(run_dir, "64MiB", "node-b", *on(pb))
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_fetch_is_byte_exact_into_scattered_pages(pair) -> None:
    a, b = pair
    ns = NS.model_copy(update={"model": "exact"})
    size = MiB + 4096  # not a whole number of pages
    ns_id, keys = put(b, ns, size, range(8))
    ca, _ = client(a, ns, size)
    # Scatter A's free space: fill with one-page chunks, free every other one, so each fetched
    # chunk lands in pages cut differently from the holder's.
    small = ns.model_copy(update={"model": "filler"})
    _, small_id = client(a, small, 64 << 10)
    free_pages = ca.stats()["free_bytes"] // (64 << 10)
    filler = put(a, small, 64 << 10, range(free_pages))[1]
    ca.delete(small_id, filler[::2])
    info_b = GrpcStoreClient(b.address).info()
    assert info_b.transfer_address and info_b.transfer_base

    result = ca.fetch(ns_id, keys, b.address)
    assert result.status is FetchStatus.OK, result
    assert (result.local, result.fetched, result.holder_hits) == (8, 8, 8)
    assert result.bytes == 8 * size and result.present == (True,) * 8
    assert_holds(a, ns, size, keys, range(8))
    lookup = ca.lookup(ns_id, keys)
    assert max(len(loc.extents) for loc in lookup.hits) > 1  # really scattered
    # Checksums arrived with the chunks (verified, stored as the holder's).
    for loc, seed in zip(lookup.hits, range(8), strict=True):
        assert loc.checksum == checksum_views([chunk(seed, size)])
    assert stored_keys(ca, EventKind.STORED) >= set(keys)  # the index learns of the copy

    again = ca.fetch(ns_id, keys, b.address)  # already local: nothing moves
    assert again.status is FetchStatus.OK and again.fetched == 0 and again.local == 8
    assert_no_leak(ca)
    assert GrpcStoreClient(b.address).stats()["remote_served_chunks"] >= 8
    metrics = scrape(a)
    assert metrics['kvtier_store_fetches_total{status="ok"}'] == 2
    assert metrics["kvtier_store_remote_fetched_bytes_total"] == 8 * size
    assert metrics["kvtier_store_fetch_seconds_count"] == 2
    # where a fetch's time went: both leased at the holder, only the first moved bytes
    phase = 'kvtier_store_fetch_phase_seconds_count{phase="%s"}'
    assert metrics[phase % "holder_lease"] == 2 and metrics[phase % "allocate"] == 2
    assert metrics[phase % "transfer"] == 1 and metrics[phase % "commit"] == 1


def test_fetch_stops_where_the_holder_stops(pair) -> None:
    a, b = pair
    ns = NS.model_copy(update={"model": "partial"})
    size = 256 << 10
    ns_id, keys = put(b, ns, size, range(6))
    ca, _ = client(a, ns, size)
    GrpcStoreClient(b.address).delete(ns_id, keys[2:3])  # evicted at the holder
    result = ca.fetch(ns_id, keys, b.address)
    assert result.status is FetchStatus.HOLDER_MISS, result
    assert (result.local, result.holder_hits, result.fetched) == (2, 2, 2)
    assert result.present == (True, True, False, False, False, False)
    unknown = keys_for(ns, range(100, 103))  # never stored anywhere
    result = ca.fetch(ns_id, unknown, b.address)
    assert (result.status, result.local, result.holder_hits) == (FetchStatus.HOLDER_MISS, 0, 0)
    assert_no_leak(ca)


def test_corrupted_chunk_is_detected_and_not_committed(pair) -> None:
    a, b = pair
    ns = NS.model_copy(update={"model": "corrupt"})
    size = 512 << 10
    ns_id, keys = put(b, ns, size, range(4))
    cb = GrpcStoreClient(b.address)
    # Make sure the holder has its checksums, then flip one byte of chunk 1 in its pool.
    lease = cb.lease_for_peer(ns_id, keys, 5)
    assert all(loc.checksum for loc in lease.hits)
    info = cb.info()
    seg = SharedSegment.attach(info.segment_name, info.segment_size)
    offset = lease.hits[1].extents[0][0] + 1234
    seg.array[offset] ^= 0xFF
    cb.release([lease.lease_id])
    seg.close()

    ca, _ = client(a, ns, size)
    result = ca.fetch(ns_id, keys, b.address)
    assert result.status is FetchStatus.CHECKSUM_MISMATCH, result
    assert result.local == 1 and result.checksum_mismatches == 1
    assert result.present == (True, False, True, True)  # the others verified and are kept
    assert ca.lookup(ns_id, keys[1:2]).stop is LookupStatus.MISS
    stats = ca.stats()
    assert stats["remote_checksum_mismatches"] == 1 and stats["remote_fetch_checksum_mismatch"] == 1
    metrics = scrape(a)
    assert metrics['kvtier_store_remote_fetch_failures_total{kind="checksum_mismatch"}'] == 1
    assert metrics["kvtier_store_remote_checksum_mismatches_total"] == 1
    assert_no_leak(ca)


def test_three_stores_a_run_from_two_holders(tmp_path: Path) -> None:
    ns = NS.model_copy(update={"model": "three"})
    size = 1 * MiB
    pa, pb, pc = peer_ports(3)
    a = remote_store(tmp_path, "32MiB", "node-a", *on(pa, pb, pc))
    b = remote_store(tmp_path, "32MiB", "node-b", *on(pb, pa))
    c = remote_store(tmp_path, "32MiB", "node-c", *on(pc))
    try:
        ns_id, _ = put(b, ns, size, range(6))
        put(c, ns, size, range(10))
        ca, _ = client(a, ns, size)
        first = ca.fetch(ns_id, keys_for(ns, range(10)), b.address)
        assert (first.status, first.local) == (FetchStatus.HOLDER_MISS, 6)
        rest = ca.fetch(ns_id, keys_for(ns, range(6, 10)), c.address)
        assert (rest.status, rest.local, rest.fetched) == (FetchStatus.OK, 4, 4)
        assert_holds(a, ns, size, keys_for(ns, range(10)), range(10))
        # B pulls the two chunks it lacks from A, which got them from C.
        cb, _ = client(b, ns, size)
        back = cb.fetch(ns_id, keys_for(ns, range(10)), a.address)
        assert (back.status, back.local, back.fetched) == (FetchStatus.OK, 10, 4)
        assert_holds(b, ns, size, keys_for(ns, range(10)), range(10))
        for store in (a, b):
            assert_no_leak(GrpcStoreClient(store.address))
    finally:
        for store in (a, b, c):
            store.stop()


def test_a_fetch_never_evicts_its_own_runs_chunks(tmp_path: Path) -> None:
    """The puller holds the run's end (its coldest chunks) and fetches the start: the
    allocation for the start must evict other chunks, never the run's own end (which the
    fetch then moved over the network a second time: 8 chunks fetched for 4 missing)."""
    ns = NS.model_copy(update={"model": "own-run"})
    size = 1 * MiB
    pa, pb = peer_ports(2)
    a = remote_store(tmp_path, "16MiB", "node-a", *on(pa, pb))
    b = remote_store(tmp_path, "16MiB", "node-b", *on(pb))
    try:
        ns_id, keys = put(b, ns, size, range(8))
        put(a, ns, size, range(4, 8))  # the run's end first: the puller's coldest
        other = ns.model_copy(update={"model": "other"})
        for seeds in (range(4), range(4, 8), range(8, 10)):  # a quarter of the pool at most
            put(a, other, size, seeds)  # 14 of 16 chunks in use: the start needs 2 evicted
        ca, _ = client(a, ns, size)
        result = ca.fetch(ns_id, keys, b.address)
        assert (result.status, result.local, result.fetched) == (FetchStatus.OK, 8, 4), result
        assert_holds(a, ns, size, keys, range(8))
        assert_no_leak(ca)
    finally:
        a.stop()
        b.stop()


def test_holder_restarted_at_the_same_address(tmp_path: Path) -> None:
    """A new holder epoch (new pool, new transfer address) behind the same gRPC address: the
    puller re-attaches, re-registers the namespace and reads from the new engine."""
    ns = NS.model_copy(update={"model": "restart"})
    size = 256 << 10
    pa, port = peer_ports(2)
    a = remote_store(tmp_path, "16MiB", "node-a", *on(pa, port))
    b = remote_store(tmp_path, "16MiB", "node-b", "--grpc-port", port)
    try:
        ns_id, keys = put(b, ns, size, range(4))
        ca, _ = client(a, ns, size)
        assert ca.fetch(ns_id, keys[:2], b.address).ok
        old_transfer = b.ready["transfer"]
        b.stop()
        b = remote_store(tmp_path, "16MiB", "node-b", "--grpc-port", port)
        assert b.ready["transfer"] != old_transfer
        put(b, ns, size, range(4))
        result = ca.fetch(ns_id, keys, b.address)
        assert (result.status, result.local, result.fetched) == (FetchStatus.OK, 4, 2), result
        assert_holds(a, ns, size, keys, range(4))
    finally:
        a.stop()
        b.stop()


# -- faults: holder killed / frozen in the middle of a transfer ------------------------------

BIG = 4 * MiB
BIG_N = 72  # 288 MiB: ~100 ms or more over loopback TCP, time enough to strike


@pytest.fixture
def big_pair(tmp_path: Path) -> Iterator[tuple[StoreProcess, StoreProcess, bytes, list[bytes]]]:
    pa, pb = peer_ports(2)
    a = remote_store(tmp_path, "384MiB", "node-a", *on(pa, pb))
    b = remote_store(tmp_path, "384MiB", "node-b", *on(pb))
    try:
        ns_id, keys = put(b, NS, BIG, range(BIG_N))
        yield a, b, ns_id, keys
    finally:
        if b.proc.poll() is None:
            os.kill(b.proc.pid, signal.SIGCONT)
        a.stop()
        b.stop()
        assert not cleanup_stale_segments(tmp_path) or b.proc.returncode == -signal.SIGKILL


def fetch_and_strike(a: StoreProcess, b: StoreProcess, ns_id, keys, sig: int):
    """Fetch in a thread; send ``sig`` to the holder once the transfer is in flight."""
    ca, _ = client(a, NS, BIG)
    out: dict = {}

    def run() -> None:
        start = time.monotonic()
        out["result"] = ca.fetch(ns_id, keys, b.address)
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    # Poll without sleeping: over fast loopback the whole transfer takes well under 100 ms, so
    # a 50 ms poll could strike after the last byte (seen on CI) and the drill would test nothing.
    deadline = time.monotonic() + 10
    while ca.stats()["remote_inflight_ops"] == 0:
        assert time.monotonic() < deadline and thread.is_alive(), "the transfer never started"
    os.kill(b.proc.pid, sig)
    thread.join(timeout=15)
    assert not thread.is_alive(), "fetch hung"
    return ca, out["result"], out["seconds"]


def test_holder_killed_mid_transfer(big_pair) -> None:
    a, b, ns_id, keys = big_pair
    ca, result, seconds = fetch_and_strike(a, b, ns_id, keys, signal.SIGKILL)
    assert result.status in (FetchStatus.TRANSFER_FAILED, FetchStatus.PEER_UNREACHABLE), result
    assert result.local < BIG_N and seconds < 3.0
    assert_holds(a, NS, BIG, keys[: result.local], range(result.local))  # what is here is right
    assert_no_leak(ca)
    if result.fetched < BIG_N:
        assert ca.stats()["quarantined_bytes"] > 0  # pages a dead transfer was writing
    wait_for(lambda: ca.stats()["quarantined_bytes"] == 0, QUARANTINE_S + 3, "quarantine end")
    stats = ca.stats()
    assert stats["used_bytes"] == stats["committed_bytes"] == result.fetched * BIG
    # The dead holder is a clean, quick error from now on.
    start = time.monotonic()
    again = ca.fetch(ns_id, keys, b.address)
    assert again.status is FetchStatus.PEER_UNREACHABLE and time.monotonic() - start < 2.5


def test_holder_frozen_mid_transfer_then_resumed(big_pair) -> None:
    a, b, ns_id, keys = big_pair
    ca, result, seconds = fetch_and_strike(a, b, ns_id, keys, signal.SIGSTOP)
    assert result.status is FetchStatus.TIMEOUT, result
    assert 1.0 < seconds < 3.0  # the 1.5 s fetch deadline, not the engine's 60 s handshake
    assert_no_leak(ca)
    assert ca.stats()["quarantined_bytes"] > 0
    os.kill(b.proc.pid, signal.SIGCONT)  # late bytes may now land in quarantined pages
    wait_for(lambda: ca.stats()["quarantined_bytes"] == 0, QUARANTINE_S + 3, "quarantine end")
    cb = GrpcStoreClient(b.address)  # the holder's lease ended too (released or expired)
    wait_for(lambda: cb.stats()["read_leases"] == 0, 10, "the holder's lease to end")
    assert_holds(a, NS, BIG, keys[: result.local], range(result.local))
    again = ca.fetch(ns_id, keys, b.address)  # the holder answers again: all of it arrives
    assert again.status is FetchStatus.OK and again.local == BIG_N, again
    assert_holds(a, NS, BIG, keys, range(BIG_N))
    assert_no_leak(ca)


def test_frozen_holder_before_the_fetch_is_a_quick_timeout(big_pair) -> None:
    a, b, ns_id, keys = big_pair
    ca, _ = client(a, NS, BIG)
    os.kill(b.proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    result = ca.fetch(ns_id, keys[:4], b.address)
    assert result.status in (FetchStatus.TIMEOUT, FetchStatus.PEER_UNREACHABLE), result
    assert time.monotonic() - start < 3.0
    assert result.local == 0 and ca.stats()["quarantined_bytes"] == 0  # nothing was sent
    os.kill(b.proc.pid, signal.SIGCONT)
    assert_no_leak(ca)


# -- demotion -------------------------------------------------------------------------------


def test_demotion_moves_cold_chunks_to_the_peer_with_room(tmp_path: Path) -> None:
    ns = NS.model_copy(update={"model": "demote"})
    size = 1 * MiB
    # The peers pull from the demoting store: it must be their peer too.
    p_hot, p_roomy, p_full = peer_ports(3)
    roomy = remote_store(tmp_path, "32MiB", "node-roomy", *on(p_roomy, p_hot))
    full = remote_store(tmp_path, "8MiB", "node-full", *on(p_full, p_hot))
    demote_env = {
        "KVTIER_STORE__REMOTE__DEMOTION__HIGH_WATERMARK": "0.5",
        "KVTIER_STORE__REMOTE__DEMOTION__LOW_WATERMARK": "0.25",
        "KVTIER_STORE__REMOTE__DEMOTION__INTERVAL_S": "0.2",
    }
    try:
        put(full, ns.model_copy(update={"model": "other"}), size, range(6))  # 75 % full
        hot = remote_store(
            tmp_path,
            "16MiB",
            "node-hot",
            "--grpc-port",
            p_hot,
            "--peers",
            f"{full.address},{roomy.address}",
            "--demotion",
            "peers",
            **demote_env,
        )
        try:
            ns_id, keys = put(hot, ns, size, range(12))  # 75 %: above the high watermark
            c_hot, _ = client(hot, ns, size)
            c_roomy, _ = client(roomy, ns, size)
            wait_for(
                lambda: c_hot.stats()["used_bytes"] <= 0.5 * (16 * MiB), 15, "demotion below 50 %"
            )
            here = set(c_hot.snapshot().chunks.get(ns_id, []))
            there = set(c_roomy.snapshot().chunks.get(ns_id, []))
            assert here | there == set(keys) and not here & there  # moved, none lost
            assert len(here) * size <= 0.5 * 16 * MiB
            # Every move is in the events: REMOVED at the source, STORED at the peer.
            assert stored_keys(c_hot, EventKind.REMOVED) == there
            assert stored_keys(c_roomy, EventKind.STORED) == there
            moved = [i for i, k in enumerate(keys) if k in there]
            assert_holds(roomy, ns, size, [keys[i] for i in moved], moved)
            assert ns_id not in GrpcStoreClient(full.address).snapshot().chunks  # full: skipped
            stats = c_hot.stats()
            assert stats["remote_demoted_chunks"] == len(there) and stats["evictions"] == 0
        finally:
            hot.stop()
    finally:
        roomy.stop()
        full.stop()
