"""Prometheus metrics for a store, kept out of the store's logic.

- ``StoreMetrics``: what the gRPC front times per call (a histogram per operation); remote
  fetches also get their own latency histogram and counters by outcome and bytes.
- ``StoreCollector`` turns the store's own ``stats()`` into gauges and counters at scrape time
  (capacity, bytes used/pinned/being written, chunks, leases, hits and misses by tier,
  evictions, expired leases), so the hot path pays nothing for them.

Each service builds its own ``CollectorRegistry``: no process-global metric state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.store.api import StoreAdmin
from kvtier.store.api.remote import FetchStatus

# Seconds; control-plane ops run from tens of microseconds to a few milliseconds.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
# A fetch moves data over the network: up to its deadline (seconds).
FETCH_BUCKETS = (5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class StoreMetrics:
    """What the gRPC front observes per call (``kvtier.store.server.grpc``): the latency of each
    control operation, and per fetch its latency, outcome and bytes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "kvtier_store_op_seconds",
            "Latency of store control operations, by operation",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fetch_latency = Histogram(
            "kvtier_store_fetch_seconds",
            "Latency of remote fetches (lease at the holder, transfer, verify, commit)",
            buckets=FETCH_BUCKETS,
            registry=registry,
        )
        self.fetch_phase_latency = Histogram(
            "kvtier_store_fetch_phase_seconds",
            "Seconds a remote fetch spent per step: holder_lease (the RPC to the holder), "
            "allocate (pages here), transfer (the bytes, verified as they land), commit",
            ["phase"],
            buckets=FETCH_BUCKETS,
            registry=registry,
        )
        self.fetches = Counter(
            "kvtier_store_fetches",
            "Remote fetches by outcome (ok, or why the local prefix fell short)",
            ["status"],
            registry=registry,
        )
        self.fetch_bytes = Counter(
            "kvtier_store_fetch_bytes", "Bytes pulled from peer stores", registry=registry
        )
        for status in FetchStatus:
            self.fetches.labels(status.value)
        self.disk_stage_latency = Histogram(
            "kvtier_store_disk_stage_seconds",
            "Latency of stages from the node's disk (read, verify, commit)",
            buckets=FETCH_BUCKETS,
            registry=registry,
        )
        self.disk_file_latency = Histogram(
            "kvtier_store_disk_file_seconds",
            "Latency of one chunk file of the disk tier, by op: write (fsync included), read "
            "(header and size checked)",
            ["op"],
            buckets=FETCH_BUCKETS,
            registry=registry,
        )


_GAUGES = {
    "capacity_bytes": "Pool capacity",
    "used_bytes": "Bytes in allocated pages (committed, being written, or awaiting unpin)",
    "committed_bytes": "Bytes of readable chunks",
    "pinned_bytes": "Bytes of chunks pinned by read leases",
    "writing_bytes": "Bytes of chunks being written",
    "largest_free_run_bytes": "Largest contiguous free run",
    "chunks": "Readable chunks",
    "writing_chunks": "Chunks being written",
    "namespaces": "Registered namespaces",
    "read_leases": "Outstanding read leases",
    "write_leases": "Outstanding write leases",
    "sessions": "Open client sessions",
    "event_seq": "Sequence number of the newest event batch",
}
_COUNTERS = {
    "lookups": "Lookup calls",
    "evictions": "Chunks evicted to make room",
    "commits": "Chunks committed",
    "aborts": "Allocated chunks given back unwritten",
    "deletes": "Chunks deleted",
    "no_space": "Chunks not stored: everything left was pinned or being written",
    "exists": "Puts of chunks already stored (idempotent)",
    "expired_read": "Read leases that expired before release",
    "expired_write": "Write leases that expired before commit",
    "quarantined": "Chunks whose pages were quarantined after a failed remote transfer",
    "quota_evictions": "Chunks a tenant at its quota evicted of its own to make room",
    "quota_no_space": "Chunks not stored: their tenant was at its quota",
    "sessions_opened": "Client sessions opened",
    "sessions_closed": "Client sessions closed by their client",
    "sessions_expired": "Client sessions ended for want of a heartbeat (the client died)",
    "session_released_read": "Read leases ended with their session (chunks unpinned)",
    "session_released_write": "Write leases ended with their session (allocations aborted)",
    "namespaces_retired": "Namespaces forgotten: no chunks left and unused for a while",
    "view_hit_chunks": "Chunks engines leased themselves from the shared view (no call)",
}
# Present with the engines' own read leases (store.view_leases).
_VIEW_GAUGES = {
    "view_pinned_chunks": "Chunks engines pin themselves now (their own read leases)",
    "view_held_chunks": "Chunks out of the pool's table whose pages an engine's pin keeps",
    "view_unmapped_chunks": "Pool chunks the lease region's map left out (leased by a call)",
}
_VIEW_COUNTERS = {
    "view_pins_expired": "Engines' pins cleared at store.max_lease_lifetime_s",
    "view_lock_misses": "Store sections run without the lease region's lock (nothing evicted)",
}
# Per tenant, by name (unlisted tenants summed as "other"; never a salt or its digest).
_TENANT_GAUGES = {
    "tenant_used_bytes": "Bytes a tenant holds (committed or being written)",
    "tenant_quota_bytes": "Most bytes a tenant may hold",
    "tenant_floor_bytes": "Bytes of a tenant no other tenant's allocation may evict",
    "disk_tenant_used_bytes": "Bytes of chunk files a tenant holds on the disk tier",
    "disk_tenant_quota_bytes": "Most bytes of chunk files a tenant may hold on the disk tier",
    "disk_tenant_floor_bytes": "Bytes of a tenant's chunk files never removed for another's",
}
# Present when the store serves a control socket (store.fast_control).
_CONTROL_COUNTERS = {
    "control_messages": "Messages received on the control socket (a batch is one)",
    "control_calls": "Calls those messages carried",
}
# Present when the disk tier is enabled (store.disk).
_DISK_GAUGES = {
    "disk_chunks": "Chunks on the node's disk",
    "disk_used_bytes": "Bytes of chunk files on disk",
    "disk_capacity_bytes": "Most bytes of chunk files kept",
    "disk_spill_queue_chunks": "Chunks the last spill round found to copy (at most a batch)",
}
_DISK_COUNTERS = {
    "disk_spilled_chunks": "Chunks copied from the pool to disk",
    "disk_spilled_bytes": "Bytes copied from the pool to disk",
    "disk_write_seconds": "Time spent writing chunk files (fsync included)",
    "disk_write_errors": "Chunk file writes that failed (ENOSPC, EIO, read-only)",
    "disk_staged_chunks": "Chunks staged from disk into the pool, checksums verified",
    "disk_staged_bytes": "Bytes staged from disk into the pool",
    "disk_read_seconds": "Time spent reading chunk files (summed over parallel reads)",
    "disk_read_errors": "Chunk file reads that failed (EIO, gone)",
    "disk_bad_files": "Chunk files that failed their checks (torn, truncated, corrupted)",
    "disk_evicted_files": "Chunk files removed (capacity, bad, failed, ENOSPC)",
    "disk_stage_calls": "Stage calls",
    "disk_quota_evictions": "Chunk files a tenant at its disk quota removed of its own",
    "disk_refused_files": "Chunk files not kept: over their tenant's disk quota, or the other "
    "tenants' disk floors left no room",
    "dirty_evictions": "Chunks evicted from the pool before the disk tier copied them (lost)",
}
# Present when the remote tier is enabled.
_REMOTE_GAUGES = {
    "quarantined_bytes": "Bytes held back from reuse: a failed transfer may still write them",
    "remote_inflight_ops": "Transfer-engine reads in flight",
}
_REMOTE_COUNTERS = {
    "remote_fetched_chunks": "Chunks pulled from peers, verified and committed",
    "remote_fetched_bytes": "Bytes pulled from peers, verified and committed",
    "remote_checksum_mismatches": "Chunks from peers whose bytes failed their checksum",
    "remote_served_chunks": "Chunks leased to peers for reading",
    "remote_served_bytes": "Bytes leased to peers for reading",
    "remote_demoted_chunks": "Chunks moved to a peer instead of being evicted",
    "remote_demoted_bytes": "Bytes moved to a peer instead of being evicted",
    "remote_demotion_failures": "Demotion rounds that moved nothing (no peer with room, errors)",
}


class StoreCollector(Collector):
    """Reads ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        chunks = CounterMetricFamily(
            "kvtier_store_lookup_chunks", "Chunks asked for by lookups", labels=["tier", "result"]
        )
        chunks.add_metric(["cpu", "hit"], stats["hit_chunks"])
        chunks.add_metric(["cpu", "miss"], stats["miss_chunks"])
        yield chunks
        for name, doc in _TENANT_GAUGES.items():
            family = GaugeMetricFamily(f"kvtier_store_{name}", doc, labels=["tenant"])
            for key, value in stats.items():
                if key.startswith(name + "."):
                    family.add_metric([key[len(name) + 1 :]], value)
            yield family
        if "view_pinned_chunks" in stats:
            for name, doc in _VIEW_GAUGES.items():
                yield GaugeMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
            for name, doc in _VIEW_COUNTERS.items():
                yield CounterMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        if "control_messages" in stats:
            for name, doc in _CONTROL_COUNTERS.items():
                yield CounterMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        if "disk_chunks" in stats:
            for name, doc in _DISK_GAUGES.items():
                yield GaugeMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
            for name, doc in _DISK_COUNTERS.items():
                yield CounterMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        if "remote_fetches" not in stats:
            return
        for name, doc in _REMOTE_GAUGES.items():
            yield GaugeMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        for name, doc in _REMOTE_COUNTERS.items():
            yield CounterMetricFamily(f"kvtier_store_{name}", doc, value=stats[name])
        failures = CounterMetricFamily(
            "kvtier_store_remote_fetch_failures",
            "Fetches that fell short, by kind",
            labels=["kind"],
        )
        for status in FetchStatus:
            if status is not FetchStatus.OK:
                failures.add_metric([status.value], stats[f"remote_fetch_{status.value}"])
        yield failures


def build_registry(store: StoreAdmin) -> tuple[StoreMetrics, CollectorRegistry]:
    """A registry of its own: ``store``'s stats at scrape time, and the per-call metrics."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store.stats))
    return StoreMetrics(registry), registry
