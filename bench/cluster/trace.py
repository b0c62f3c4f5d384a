"""The trace of ``kvtier bench cluster``: a real trace made small enough for a laptop.

1. **Sample** with the trace tools' window + thinning sampler (``trace/sample.py``): whole
   sessions, prefix groups kept or dropped together, so cross-session sharing survives.
2. **Cut** to the first ``limit`` requests, and **cap** each prompt at ``max_prompt_tokens``
   sent tokens by dropping its trailing hash ids (a hash id names a block *and its prefix*, so
   a capped prompt still shares exactly the prefix it shared before, up to the cap).
   Optionally **close gaps**: a pause between two arrivals longer than ``max_gap_s`` (trace
   seconds) shrinks to it. A sampled window keeps its sessions whole, so their later turns
   trickle in for minutes after the window; this brings them closer without reordering.
3. **Scale** at send time: each trace block (512 tokens in Mooncake) becomes ``block_tokens``
   token ids (``trace/prompts.py``), so lengths scale by ``block_tokens / 512``; output
   lengths are capped at ``max_output_tokens``; arrival times multiply by ``time_scale``.

The result is a session-format trace in the run's folder, replayed identically to every
configuration. Token classes (warm / medium / heavy) are decided on the trace's uncached
(infinite-cache) tokens, in trace tokens; the report gives the bounds in sent tokens too,
which is the same split scaled with the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.analyze import analyze_file
from kvtier.traces.formats import (
    DEFAULT_BLOCK_TOKENS,
    TraceFormat,
    TraceReader,
    TraceWriter,
)
from kvtier.traces.prompts import DEFAULT_CLASSES, PromptBuilder, PromptSpec, parse_classes
from kvtier.traces.sample import SampleOptions, sample_file

DEFAULT_TRACE = Path("/work/shared/data/traces/mooncake_synthetic_trace.jsonl")


@dataclass(frozen=True)
class TracePlan:
    path: Path = DEFAULT_TRACE
    fmt: TraceFormat = TraceFormat.AUTO
    sample: SampleOptions = field(default_factory=SampleOptions)
    limit: int | None = None  # requests kept after sampling (the first ones)
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per hash id in the trace
    block_tokens: int = 16  # tokens sent per hash id: the length scale
    max_prompt_tokens: int = 2000  # sent tokens; longer prompts lose their trailing blocks
    max_output_tokens: int = 16
    time_scale: float = 1.0
    max_gap_s: float | None = None  # longer pauses between arrivals shrink to this
    classes: str = DEFAULT_CLASSES  # by uncached trace tokens

    @property
    def scale(self) -> float:
        return self.block_tokens / self.trace_block_tokens

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < self.block_tokens:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, "max prompt tokens must cover one trace block"
            )
        if self.time_scale <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "time scale must be > 0")
        if self.max_gap_s is not None and self.max_gap_s <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "max gap must be > 0 seconds")
        if self.limit is not None and self.limit < 1:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "limit must be >= 1")
        parse_classes(self.classes)  # fail early on a bad class spec

    def prompt_spec(self, vocab_size: int, seed: int = 0) -> PromptSpec:
        return PromptSpec(self.block_tokens, self.trace_block_tokens, vocab_size, 16, seed)

    def class_bounds(self) -> list[dict[str, Any]]:
        """Each class with its upper bound in trace tokens and in sent tokens."""
        return [
            {
                "name": c.name,
                "below_trace_tokens": c.below,
                "below_sent_tokens": None if c.below is None else round(c.below * self.scale),
            }
            for c in parse_classes(self.classes)
        ]


def prepare(plan: TracePlan, workdir: Path, vocab_size: int) -> tuple[Path, dict[str, Any]]:
    """Sample, cut and cap ``plan.path`` into ``workdir/trace.jsonl``; (its path, a report)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sampled = workdir / "sampled.jsonl"
    sampling = sample_file(plan.path, sampled, plan.sample, plan.fmt, plan.trace_block_tokens)
    out = workdir / "trace.jsonl"
    tbt = plan.trace_block_tokens
    max_blocks = plan.max_prompt_tokens // plan.block_tokens
    builder = PromptBuilder(plan.prompt_spec(vocab_size))
    capped = 0
    prompts: list[int] = []
    outputs: list[int] = []
    first_ts = last_ts = 0.0
    previous: float | None = None  # the source timestamp of the previous request
    closed = 0.0  # ms of pauses removed so far
    with TraceWriter(out, TraceFormat.SESSION) as writer:
        for req in TraceReader(sampled, TraceFormat.SESSION, tbt):
            if plan.limit is not None and writer.count >= plan.limit:
                break
            gap = 0.0 if previous is None else req.timestamp - previous
            previous = req.timestamp
            if plan.max_gap_s is not None and gap > plan.max_gap_s * 1000.0:
                closed += gap - plan.max_gap_s * 1000.0
            changes: dict[str, Any] = {"timestamp": req.timestamp - closed}
            if len(req.hash_ids) > max_blocks:
                changes.update(hash_ids=req.hash_ids[:max_blocks], input_length=max_blocks * tbt)
                capped += 1
            req = msgspec.structs.replace(req, **changes)
            if writer.count == 0:
                first_ts = req.timestamp
            last_ts = req.timestamp
            writer.write(req)
            prompts.append(builder.prompt_length(req.input_length, len(req.hash_ids)))
            outputs.append(min(req.output_length, plan.max_output_tokens))
    if not prompts:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, "the sample is empty: a wider window or a higher ratio"
        )
    analysis = analyze_file(out, TraceFormat.SESSION, tbt)
    duration_s = (last_ts - first_ts) / 1000.0 * plan.time_scale
    report = {
        "source": str(plan.path),
        "sampling": sampling["options"],
        "sample_figures": sampling["figures"]["sample"],
        "requests": len(prompts),
        "sessions": analysis["sessions"]["count"],
        "capped_requests": capped,
        "scale": {
            "block_tokens": plan.block_tokens,
            "trace_block_tokens": tbt,
            "length_scale": plan.scale,
            "max_prompt_tokens": plan.max_prompt_tokens,
            "max_output_tokens": plan.max_output_tokens,
            "time_scale": plan.time_scale,
            "max_gap_s": plan.max_gap_s,
            "gaps_closed_s": closed / 1000.0,
        },
        "prompt_tokens": _dist(prompts),
        "output_tokens": _dist(outputs),
        "duration_s": duration_s,
        "arrival_rate_per_s": len(prompts) / duration_s if duration_s > 0 else None,
        "infinite_cache_hit_ratio": analysis["infinite_cache"]["hit_ratio_tokens"],
        "cross_session_hit_share": analysis["sessions"]["cross_session_hit_share"],
        "classes": plan.class_bounds(),
    }
    return out, report


def _dist(values: list[int]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {
        "total": float(arr.sum()),
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "max": float(arr.max()),
    }
