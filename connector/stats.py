"""kvtier's numbers inside vLLM's metrics: per-step stats and Prometheus counters.

Both connector roles count into plain dicts; vLLM ships them from the scheduler and workers to
the front end (``KvtierStats``: summed across workers and steps), logs them periodically
(``KV Transfer metrics: ...``) and feeds ``KvtierPromMetrics`` (``vllm:kvtier_*``), so a
``/metrics`` scrape of vLLM shows kvtier's hits by tier, bytes moved and load errors.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# stat key -> (prometheus name, help). Counters: the values are deltas since the last report.
COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:kvtier_lookups", "Prompts looked up in kvtier's tiers"),
    "lookup_tokens": ("vllm:kvtier_lookup_tokens", "Prompt tokens past vLLM's own hit, asked"),
    "lookups_pending": (
        "vllm:kvtier_lookups_pending",
        "Times vLLM was told to ask again while a lookup was in flight",
    ),
    "lookup_errors": ("vllm:kvtier_lookup_errors", "Lookups that failed (treated as misses)"),
    "cpu_hit_tokens": ("vllm:kvtier_cpu_hit_tokens", "Tokens loaded from the node DRAM pool"),
    "cpu_skipped_tokens": (
        "vllm:kvtier_cpu_skipped_tokens",
        "DRAM hits shorter than min_hit_tokens, recomputed instead",
    ),
    "remote_hit_tokens": (
        "vllm:kvtier_remote_hit_tokens",
        "Tokens loaded from another node's pool",
    ),
    "remote_pulled_chunks": (
        "vllm:kvtier_remote_pulled_chunks",
        "Chunks pulled from other nodes' stores into this node's",
    ),
    "remote_fetched_bytes": (
        "vllm:kvtier_remote_fetched_bytes",
        "Bytes pulled from other nodes' stores",
    ),
    "remote_fetch_seconds": ("vllm:kvtier_remote_fetch_seconds", "Time spent pulling"),
    "remote_fetch_errors": ("vllm:kvtier_remote_fetch_errors", "Pulls that raised"),
    "remote_fetch_holder_miss": (
        "vllm:kvtier_remote_fetch_holder_miss",
        "Pulls cut short: the holder no longer had the chunks",
    ),
    "remote_fetch_peer_unreachable": (
        "vllm:kvtier_remote_fetch_peer_unreachable",
        "Pulls that found the holder unreachable",
    ),
    "remote_fetch_timeout": ("vllm:kvtier_remote_fetch_timeout", "Pulls past their deadline"),
    "remote_fetch_transfer_failed": (
        "vllm:kvtier_remote_fetch_transfer_failed",
        "Pulls whose transfer failed (holder died mid-way)",
    ),
    "remote_fetch_checksum_mismatch": (
        "vllm:kvtier_remote_fetch_checksum_mismatch",
        "Pulls that received bytes failing their checksum",
    ),
    "remote_index_errors": ("vllm:kvtier_remote_index_errors", "Index queries that failed"),
    "remote_index_repairs": (
        "vllm:kvtier_remote_index_repairs",
        "Stale index entries removed after a holder miss",
    ),
    "loaded_chunks": ("vllm:kvtier_loaded_chunks", "Chunks copied into vLLM's KV"),
    "loaded_bytes": ("vllm:kvtier_loaded_bytes", "Bytes copied into vLLM's KV"),
    "load_error_blocks": (
        "vllm:kvtier_load_error_blocks",
        "KV blocks whose load failed and were recomputed",
    ),
    "load_failed_requests": ("vllm:kvtier_load_failed_requests", "Requests with a failed load"),
    "lease_lapsed_loads": (
        "vllm:kvtier_lease_lapsed_loads",
        "Loads refused because their lease was about to lapse",
    ),
    "saved_chunks": ("vllm:kvtier_saved_chunks", "Chunks copied from vLLM's KV into the pool"),
    "committed_chunks": (
        "vllm:kvtier_committed_chunks",
        "Saved chunks committed (readable by every instance on the node)",
    ),
    "saved_bytes": ("vllm:kvtier_saved_bytes", "Bytes copied from vLLM's KV into the pool"),
    "save_exists": ("vllm:kvtier_save_exists", "Chunks not saved: already in the pool"),
    "save_no_space": (
        "vllm:kvtier_save_no_space",
        "Chunks not saved: the pool was full of pinned chunks",
    ),
    "save_errors": ("vllm:kvtier_save_errors", "Saves that failed"),
}


class KvtierStats(KVConnectorStats):
    """A flat dict of counters; aggregation sums them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if v}
        load_s = self.data.get("load_seconds", 0)
        if load_s:
            out["load_GBps"] = round(self.data.get("loaded_bytes", 0) / load_s / 1e9, 2)
        save_s = self.data.get("save_seconds", 0)
        if save_s:
            out["save_GBps"] = round(self.data.get("saved_bytes", 0) / save_s / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in COUNTERS.items()
        }
        self._children = {
            engine: {key: c.labels(*values) for key, c in self._counters.items()}
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children[engine_idx]
        for key, value in transfer_stats_data.items():
            child = children.get(key)
            if child is not None and value:
                child.inc(value)
