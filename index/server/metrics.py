"""Prometheus metrics of the index, kept out of its logic.

- ``MeteredIndex`` wraps any ``ChunkIndex``: a latency histogram per operation (queries in
  their own histogram, per prompt) and query outcomes.
- ``IndexCollector`` reads, at scrape time, the backend's figures (entries per tier,
  locations up/down, health, resets: times it lost its data, and whether sources are still
  resyncing after one) and the followers' counters (events ingested by source and type,
  vLLM blocks, gaps recovered and lost, rejected input, resyncs, restarts, source state).

Each service builds its own ``CollectorRegistry``: no process-global metric state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.core.chunks import Tier
from kvtier.core.errors import KvtierError
from kvtier.index.api import (
    INDEX_TIERS,
    ApplyStatus,
    ChunkIndex,
    ChunkOp,
    ForwardingIndex,
    IndexHealth,
    Query,
    QueryResult,
)
from kvtier.index.ingest.follower import SourceState, SourceStats

# Seconds: an in-memory query of a 128k-token prompt takes ~0.1-1 ms, a Redis one a few ms.
QUERY_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class MeteredIndex(ForwardingIndex):
    def __init__(self, inner: ChunkIndex, registry: CollectorRegistry) -> None:
        super().__init__(inner)
        self._query = Histogram(
            "kvtier_index_query_seconds",
            "Latency of one query call (a batch of prompts)",
            buckets=QUERY_BUCKETS,
            registry=registry,
        )
        self._prompts = Counter(
            "kvtier_index_prompts",
            "Prompts asked about, by outcome",
            ["outcome"],  # hit (some location holds a run) | miss | degraded | error
            registry=registry,
        )
        self._ops = Histogram(
            "kvtier_index_op_seconds",
            "Latency of index writes and housekeeping, by operation",
            ["op"],
            buckets=QUERY_BUCKETS,
            registry=registry,
        )

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        start = time.perf_counter()
        try:
            results = self.inner.query(queries)
        except KvtierError:
            self._prompts.labels("error").inc(len(queries))
            raise
        finally:
            self._query.observe(time.perf_counter() - start)
        for result in results:
            if result.health is IndexHealth.DEGRADED:
                self._prompts.labels("degraded").inc()
            else:
                self._prompts.labels("hit" if result.holdings else "miss").inc()
        return results

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._ops.labels(op).observe(time.perf_counter() - start)

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        return self._timed(
            "apply",
            self.inner.apply,
            location,
            ops,
            epoch=epoch,
            seq_from=seq_from,
            seq_to=seq_to,
        )

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        self._timed("replace", self.inner.replace, location, holdings, epoch=epoch, seq=seq)

    def reap(self, timeout_s: float) -> list[str]:
        return self._timed("reap", self.inner.reap, timeout_s)


class IndexCollector(Collector):
    """Backend figures and followers' counters, read at scrape time."""

    def __init__(
        self,
        index: ChunkIndex,
        sources: Callable[[], list[SourceStats]],
        resyncing: Callable[[], list[str]] = list,
    ) -> None:
        """``resyncing``: the sources still resending their state after a backend reset."""
        self._index = index
        self._sources = sources
        self._resyncing = resyncing

    def collect(self) -> Iterator[Any]:
        health, _ = self._index.health()
        yield GaugeMetricFamily(
            "kvtier_index_degraded",
            "1 when the backend is (partly) unreachable, or resyncing after it lost its data, "
            "and answers may be empty",
            value=1.0 if health is IndexHealth.DEGRADED else 0.0,
        )
        resets = self._index.backend_resets()
        yield CounterMetricFamily(
            "kvtier_index_backend_resets",
            "Times the backend was found to have lost its data (e.g. a Redis restarted empty)",
            value=resets.resets,
        )
        yield CounterMetricFamily(
            "kvtier_index_backend_restarts",
            "Times the backend restarted with its data kept (nothing to resync)",
            value=resets.restarts,
        )
        resyncing = resets.recovering or bool(resets.resets and self._resyncing())
        yield GaugeMetricFamily(
            "kvtier_index_resyncing",
            "1 while the index rebuilds itself after its backend lost its data (registrations, "
            "then every source's whole state)",
            value=1.0 if resyncing else 0.0,
        )
        try:
            stats = self._index.stats()
        except KvtierError:
            stats = None
        if stats is not None:
            entries = GaugeMetricFamily(
                "kvtier_index_entries", "Chunk entries (chunk, location) by tier", labels=["tier"]
            )
            for tier in INDEX_TIERS:
                entries.add_metric([tier.value], float(stats.get(f"entries_{tier.value}", 0)))
            yield entries
            locations = GaugeMetricFamily(
                "kvtier_index_locations", "Registered locations by status", labels=["status"]
            )
            locations.add_metric(["up"], float(stats.get("locations_up", 0)))
            locations.add_metric(["down"], float(stats.get("locations_down", 0)))
            yield locations
            yield GaugeMetricFamily(
                "kvtier_index_namespaces",
                "Known namespaces",
                value=float(stats.get("namespaces", 0)),
            )
        yield from self._source_metrics(self._sources())

    @staticmethod
    def _source_metrics(sources: list[SourceStats]) -> Iterator[Any]:
        events = CounterMetricFamily(
            "kvtier_index_events",
            "Source events ingested, by source and type",
            labels=["source", "kind", "type"],
        )
        blocks = CounterMetricFamily(
            "kvtier_index_vllm_blocks", "vLLM blocks stored (BlockStored)", labels=["source"]
        )
        batches = CounterMetricFamily(
            "kvtier_index_batches", "Source event batches applied", labels=["source", "kind"]
        )
        gaps = CounterMetricFamily(
            "kvtier_index_gaps",
            "Sequence gaps, recovered (replay, snapshot) or lost (batches gone)",
            labels=["source", "outcome"],
        )
        rejected = CounterMetricFamily(
            "kvtier_index_rejected",
            "Input skipped, by source and reason",
            labels=["source", "reason"],
        )
        resyncs = CounterMetricFamily(
            "kvtier_index_resyncs", "Whole-state writes of a source", labels=["source"]
        )
        restarts = CounterMetricFamily(
            "kvtier_index_source_restarts", "Restarts of a source detected", labels=["source"]
        )
        state = GaugeMetricFamily(
            "kvtier_index_source_state",
            "1 for the state each source is in",
            labels=["source", "state"],
        )
        for s in sources:
            for kind, n in s.events.items():
                events.add_metric([s.source, s.kind, kind], n)
            if s.kind == "vllm":
                blocks.add_metric([s.source], s.blocks)
            batches.add_metric([s.source, s.kind], s.batches)
            gaps.add_metric([s.source, "recovered"], s.gaps_recovered)
            gaps.add_metric([s.source, "lost"], s.gaps_lost)
            for reason, n in s.rejected.items():
                rejected.add_metric([s.source, reason], n)
            resyncs.add_metric([s.source], s.resyncs)
            restarts.add_metric([s.source], s.restarts)
            for st in SourceState:
                state.add_metric([s.source, st.value], 1.0 if s.state is st else 0.0)
        yield from (events, blocks, batches, gaps, rejected, resyncs, restarts, state)


def build_registry(
    index: ChunkIndex,
    sources: Callable[[], list[SourceStats]],
    resyncing: Callable[[], list[str]] = list,
) -> tuple[MeteredIndex, CollectorRegistry]:
    registry = CollectorRegistry()
    registry.register(IndexCollector(index, sources, resyncing))
    return MeteredIndex(index, registry), registry
