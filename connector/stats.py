"""kvtier's numbers inside vLLM's metrics: per-step stats and Prometheus counters.

Both connector roles count declared counters (``counters.py``) into a ``Tally``; vLLM ships
them from the scheduler and workers to the front end (``KvtierStats``: summed across workers
and steps), logs them periodically (``KV Transfer metrics: ...``) and feeds
``KvtierPromMetrics`` (``vllm:kvtier_*``), so a ``/metrics`` scrape of vLLM shows kvtier's
hits by tier, bytes moved and load errors.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.connector.counters import ALL


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
            c.name: self._counter_cls(
                name=c.prometheus, documentation=c.help, labelnames=labelnames
            )
            for c in ALL
            if not c.internal
        }
        self._children = {
            engine: {key: c.labels(*values) for key, c in self._counters.items()}
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # every name here comes from a declared Counter (counters.py), so none is dropped;
        # derived rates (load_GBps) and internal seconds are log-only
        children = self._children[engine_idx]
        for key, value in transfer_stats_data.items():
            child: Any = children.get(key)
            if child is not None and value:
                child.inc(value)
