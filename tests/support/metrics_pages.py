"""The reading of a vLLM ``/metrics`` page that ``kvtier.router.engine_load`` replaced: every
sample through ``prometheus_client``'s parser. Tests compare the two."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvtier.router.engine_load import GAUGES, KV_USAGE, RUNNING, WAITING, EngineLoad


def full_parse(text: str) -> EngineLoad:
    sums = dict.fromkeys(GAUGES, 0.0)
    counts = dict.fromkeys(GAUGES, 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums and "reason" not in sample.labels:
                sums[sample.name] += sample.value
                counts[sample.name] += 1
    usage = sums[KV_USAGE] / counts[KV_USAGE] if counts[KV_USAGE] else 0.0
    return EngineLoad(int(sums[RUNNING]), int(sums[WAITING]), usage)
