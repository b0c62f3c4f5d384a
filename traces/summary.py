"""Summaries of replay results: percentiles overall and per class, errors counted, cache hits.

Works on ``ReplayResult`` objects or on the dicts of a results JSONL, so a run can be
summarised again later (``kvtier trace summarize``). Warm-up requests are counted but left out
of the latency figures. Streams: a result costs three floats (in arrays) once folded in.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np

QUANTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "e2e_s")


def _pcts(values: array) -> dict[str, float | None]:
    if not len(values):
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    arr = np.frombuffer(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in QUANTILES}}


class _Group:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(("requests", "ok", "errors", "timeouts"), 0)
        self.values = {m: array("d") for m in METRICS}

    def add(self, r: Mapping[str, Any]) -> None:
        self.counts["requests"] += 1
        status = r["status"]
        key = {"ok": "ok", "error": "errors", "timeout": "timeouts"}.get(status, "errors")
        self.counts[key] += 1
        if status == "ok":
            for m in METRICS:
                if r.get(m) is not None:
                    self.values[m].append(r[m])

    def report(self) -> dict[str, Any]:
        return {**self.counts, **{m: _pcts(self.values[m]) for m in METRICS}}


def summarize(results: Iterable[Any], classes: list[str] | None = None) -> dict[str, Any]:
    recorded = warmup = 0
    overall = _Group()
    groups: dict[str, _Group] = {name: _Group() for name in classes or ()}
    errors: Counter[str] = Counter()
    prompt = expected = cached = cached_prompt = reported = out_tokens = ok = 0
    begin, end, lag = float("inf"), float("-inf"), 0.0
    for item in results:
        r = asdict(item) if is_dataclass(item) else item  # type: ignore[arg-type]
        recorded += 1
        if r.get("warmup"):
            warmup += 1
            continue
        overall.add(r)
        groups.setdefault(r["cls"], _Group()).add(r)
        if r["status"] != "ok":
            errors[_error_kind(r["error"])] += 1
            continue
        ok += 1
        prompt += r["prompt_tokens"]
        expected += r["expected_cached_tokens"]
        out_tokens += r["output_tokens"]
        if r.get("cached_tokens") is not None:
            reported += 1
            cached += r["cached_tokens"]
            cached_prompt += r["prompt_tokens"]
        begin = min(begin, r["sent_s"])
        end = max(end, r["sent_s"] + r["e2e_s"])
        lag = max(lag, r.get("lag_s", 0.0))
    summary: dict[str, Any] = {"recorded": recorded, "warmup": warmup, **overall.report()}
    names = classes or sorted(groups)
    summary["classes"] = {name: groups[name].report() for name in names}
    summary["error_kinds"] = dict(errors.most_common(10))
    summary["prefix_cache"] = {
        "prompt_tokens": prompt,
        "expected_cached_tokens": expected,
        "expected_ratio": _ratio(expected, prompt),
        "reported_requests": reported,
        "cached_tokens": cached if reported else None,
        "cached_ratio": _ratio(cached, cached_prompt) if reported else None,
    }
    if ok:
        span = max(end - begin, 1e-9)
        summary["throughput"] = {
            "duration_s": span,
            "requests_per_s": ok / span,
            "output_tokens_per_s": out_tokens / span,
            "lag_s_max": lag,
        }
    return summary


def _error_kind(message: str | None) -> str:
    """Group messages that differ only in numbers (ids, lengths)."""
    return re.sub(r"\d+", "N", (message or "unknown")[:120])


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def print_summary(summary: dict[str, Any], title: str = "replay") -> None:
    from rich.table import Table

    from kvtier.traces.report import make_console

    console = make_console()
    head = Table(title=title)
    for col in ("recorded", "warm-up", "measured", "ok", "errors", "timeouts"):
        head.add_column(col, justify="right")
    head.add_row(
        str(summary["recorded"]),
        str(summary["warmup"]),
        str(summary["requests"]),
        str(summary["ok"]),
        str(summary["errors"]),
        str(summary["timeouts"]),
    )
    console.print(head)
    table = Table(title="latency (s): p50 / p90 / p99")
    table.add_column("class")
    table.add_column("n", justify="right")
    table.add_column("err+timeout", justify="right")
    for metric in METRICS:
        table.add_column(metric.removesuffix("_s").upper(), justify="right")
    rows = [("all", summary), *summary["classes"].items()]
    for name, group in rows:
        table.add_row(
            name,
            str(group["requests"]),
            str(group["errors"] + group["timeouts"]),
            *(_fmt(group[m]) for m in METRICS),
        )
    console.print(table)
    cache = summary["prefix_cache"]
    line = f"prefix cache: expected (infinite cache) {cache['expected_ratio']:.1%}"
    if cache["cached_ratio"] is not None:
        line += f", server-reported {cache['cached_ratio']:.1%} of prompt tokens"
    console.print(line)
    if summary.get("server_metrics"):
        console.print(f"server metrics delta: {summary['server_metrics']}")
    if summary["error_kinds"]:
        console.print(f"errors: {summary['error_kinds']}")
    if "throughput" in summary:
        t = summary["throughput"]
        console.print(
            f"{t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.1f} output tok/s over "
            f"{t['duration_s']:.1f} s; max send lag {t['lag_s_max']:.3f} s"
        )


def _fmt(stats: dict[str, float | None]) -> str:
    if stats["p50"] is None:
        return "-"
    return " / ".join(f"{stats[f'p{q}']:.3f}" for q in QUANTILES)
