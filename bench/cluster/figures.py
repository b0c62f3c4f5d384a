"""The figures of ``kvtier bench cluster`` from what the processes export: vLLM's per-source
prefix-hit counters per instance (before / after the run), the router's decision histogram
and decision log. Pure functions of those numbers (tested without any process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.traces.replay import ReplayResult

CACHED = "vllm:prompt_tokens_cached_by_source_total"
SOURCES = ("device", "host", "p2p", "external_unspecified")
DECISION = "kvtier_router_decision_seconds"


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _by_source(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {s: _delta(before, after, f"{CACHED}{{source={s}}}") for s in SOURCES}


def tier_hits(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """Prompt tokens served by each source over the run, summed over instances, and as a
    share of all prompt tokens."""
    tokens = {s: 0.0 for s in SOURCES}
    prompt = 0.0
    for name in after:
        for s, v in _by_source(before[name], after[name]).items():
            tokens[s] += v
        prompt += _delta(before[name], after[name], "vllm:prompt_tokens_total")
    ratio = {s: tokens[s] / prompt if prompt else 0.0 for s in SOURCES}
    return {
        "prompt_tokens": prompt,
        "tokens": tokens,
        "ratio": ratio,
        "dram_ratio": ratio["host"] + ratio["external_unspecified"],
        "hit_ratio": sum(ratio.values()),
    }


def instance_figures(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    results: list[ReplayResult],
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in after:
        b, a = before[name], after[name]
        prompt = _delta(b, a, "vllm:prompt_tokens_total")
        cached = _by_source(b, a)
        hit = sum(cached.values())
        routed = [r for r in results if r.meta.get("instance") == name]
        out[name] = {
            "requests": len(routed),  # as the router's x-kvtier-instance header said
            "engine_requests": _delta(b, a, "vllm:request_success_total"),  # + router probes
            "prompt_tokens": prompt,
            "computed_tokens": prompt - hit,
            "cached_tokens": cached,
            "hit_ratio": hit / prompt if prompt else 0.0,
        }
    return out


# A request that hit nothing and whose prompt is at least this long: what a TTFT p90 on this
# benchmark's ~300-token prompts is made of (shorter misses cost little either way).
LONG_MISS_TOKENS = 200


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90))}


def hit_split(results: list[ReplayResult]) -> dict[str, Any]:
    """TTFT of the requests that hit (vLLM's ``cached_tokens`` > 0, any tier) and of the long
    misses, and a long miss's TTFT per prompt token (its prefill beside whatever else the
    instance ran, queueing included). Compared across configurations on one trace, the
    per-token figure says what each configuration costs a request it cannot help."""
    # (TTFT, prompt tokens, cached tokens) of every answered request of the trace
    done = [
        (r.ttft_s, r.prompt_tokens, r.cached_tokens or 0)
        for r in results
        if r.status == "ok" and not r.warmup and r.ttft_s is not None
    ]
    hits = [ttft for ttft, _, cached in done if cached]
    misses = [(ttft, n) for ttft, n, cached in done if not cached and n >= LONG_MISS_TOKENS]
    return {
        "hits": {"requests": len(hits), "ttft_s": _quantiles(hits)},
        "long_misses": {
            "requests": len(misses),
            "min_prompt_tokens": LONG_MISS_TOKENS,
            "ttft_s": _quantiles([ttft for ttft, _ in misses]),
            "ms_per_token": _quantiles([1e3 * ttft / n for ttft, n in misses]),
        },
    }


STEPS = "vllm:iteration_tokens_total_count"  # one observation per engine step
PREEMPTIONS = "vllm:num_preemptions_total"
HOOK_SECONDS = {
    "scheduler": "vllm:kvtier_scheduler_hook_seconds_total",
    "worker": "vllm:kvtier_worker_hook_seconds_total",
}


def engine_figures(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """Summed over instances: engine steps, preemptions, and the milliseconds per step vLLM
    spent inside kvtier's hooks, scheduler and workers (0 without kvtier's connector): what
    the connector adds to every step, as the engines measured it during the run."""
    steps = sum(_delta(before[n], after[n], STEPS) for n in after)
    hook_s = {
        role: sum(_delta(before[n], after[n], metric) for n in after)
        for role, metric in HOOK_SECONDS.items()
    }
    return {
        "steps": steps,
        "preemptions": sum(_delta(before[n], after[n], PREEMPTIONS) for n in after),
        "hook_seconds": hook_s,
        "hook_ms_per_step": ms_per_step(hook_s, steps),
    }


def ms_per_step(seconds: dict[str, float], steps: float) -> dict[str, float]:
    """Seconds (by role) over engine steps, in ms a step (0 without steps)."""
    return {r: 1e3 * v / steps if steps else 0.0 for r, v in seconds.items()}


def imbalance(instances: dict[str, dict[str, Any]]) -> dict[str, float]:
    """max / mean over instances (1 = even) of requests, prompt tokens and computed tokens."""
    out: dict[str, float] = {}
    for key in ("requests", "prompt_tokens", "computed_tokens"):
        values = [float(f[key]) for f in instances.values()]
        mean = sum(values) / len(values) if values else 0.0
        out[key] = max(values) / mean if mean > 0 else 0.0
    return out


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: ``buckets`` (upper bound, cumulative count), sorted;
    linear inside the bucket the rank falls in; the top finite bound past it."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def decision_latency(
    before: dict[str, float], after: dict[str, float], workdir: Path, since: float
) -> dict[str, Any]:
    """From the router's histogram (delta over the run) and, exactly, its decision log."""
    prefix = f"{DECISION}_bucket{{le="
    buckets = sorted(
        (float(k[len(prefix) : -1]), _delta(before, after, k))
        for k in after
        if k.startswith(prefix)
    )
    count = _delta(before, after, f"{DECISION}_count")
    total = _delta(before, after, f"{DECISION}_sum")
    out: dict[str, Any] = {
        "count": count,
        "mean_s": total / count if count else None,
        **{f"p{q}_s": histogram_quantile(buckets, q / 100) for q in (50, 90, 99)},
    }
    log = workdir / "decisions.jsonl"
    if log.exists():
        import numpy as np

        ms = [
            rec["decision_ms"]
            for rec in map(json.loads, log.read_text().splitlines())
            if rec.get("t", 0) >= since
        ]
        if ms:
            out["log"] = {
                "decisions": len(ms),
                **{f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)},
                "max_ms": float(max(ms)),
            }
    return out
