"""An instance's load, read from its vLLM ``/metrics`` page without parsing the whole page.

The router scrapes every instance's ``/metrics`` every ``router.scrape_s`` and needs three
gauges of it. vLLM's page is ~1,000 lines (~80 KB: histograms of every latency), and
``prometheus_client``'s parser took 15 ms to read one on this project's 2-core host, on the
router's event loop: with 16 instances a quarter of a core, and any routing decision that
arrives during a parse waits for it. ``engine_load`` finds just the lines of the gauges it needs
(microseconds; ``kvtier bench router`` prints both).

What counts: samples of the three gauges without a ``reason`` label (vLLM adds per-reason
breakdowns under other names today; a future one under the same name would double-count).
Running and waiting requests are summed over the page's engines (data-parallel ranks serve
one endpoint); KV usage is their mean, so it stays a fill fraction 0..1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GAUGES = (RUNNING, WAITING, KV_USAGE)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1


def engine_load(text: str) -> EngineLoad:
    """The load a vLLM ``/metrics`` page reports (zeros for gauges it does not carry).

    Raises ``ValueError`` on a sample of those gauges it cannot read (the caller keeps the
    instance's last load)."""
    sums = dict.fromkeys(GAUGES, 0.0)
    counts = dict.fromkeys(GAUGES, 0)
    for name in GAUGES:
        for labels, value in _samples(text, name):
            if "reason" in labels:
                continue
            sums[name] += value
            counts[name] += 1
    usage = sums[KV_USAGE] / counts[KV_USAGE] if counts[KV_USAGE] else 0.0
    return EngineLoad(int(sums[RUNNING]), int(sums[WAITING]), usage)


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in an exposition-format page: (labels, value)."""
    out = []
    pos = 0
    while (at := text.find(name, pos)) >= 0:
        pos = at + len(name)
        end = text.find("\n", pos)
        if end < 0:
            end = len(text)
        # the whole name at the start of a line: not a longer name, not inside a comment
        if (at and text[at - 1] != "\n") or pos >= end or text[pos] not in "{ \t":
            continue
        labels, rest = _labels(text, pos, end) if text[pos] == "{" else ({}, text[pos:end])
        fields = rest.split()  # value, then an optional timestamp
        if not fields:
            raise ValueError(f"{name}: a sample without a value")
        value = float(fields[0])  # ValueError for what is not a number; NaN and Inf parse
        if not math.isfinite(value):
            raise ValueError(f"{name}: value {fields[0]}")
        out.append((labels, value))
        pos = end
    return out


def _labels(text: str, pos: int, end: int) -> tuple[dict[str, str], str]:
    """Labels of the ``{...}`` at ``text[pos]`` (values may hold spaces, braces, escaped
    quotes) and what follows them on the line."""
    labels: dict[str, str] = {}
    i = pos + 1
    while True:
        while i < end and text[i] in " \t,":
            i += 1
        if i >= end:
            raise ValueError("unterminated labels")
        if text[i] == "}":
            return labels, text[i + 1 : end]
        eq = text.find("=", i, end)
        if eq < 0 or eq + 1 >= end or text[eq + 1] != '"':
            raise ValueError("malformed label")
        key = text[i:eq].strip()
        j = eq + 2
        chars = []
        while j < end and text[j] != '"':
            if text[j] == "\\" and j + 1 < end:
                j += 1
                chars.append({"n": "\n"}.get(text[j], text[j]))
            else:
                chars.append(text[j])
            j += 1
        if j >= end:
            raise ValueError("unterminated label value")
        labels[key] = "".join(chars)
        i = j + 1
