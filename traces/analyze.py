"""``kvtier trace analyze``: what a trace asks of a KV cache, in one streaming pass.

Figures (all computed as the reference README defines them):
- request and token counts, input/output percentiles (numpy's linear interpolation);
- block reuse: distinct blocks over block references;
- the prefix hit ratio of an infinite cache: each request hits its leading blocks already seen
  (stopping at the first unseen one), in blocks and in tokens (hit tokens capped at the
  request's input_length, since the last block is usually partial);
- intra- vs cross-session shares of those hits (see sessions.py for derived sessions);
- prefix repetition from a radix tree (see radix.py).

Memory: two integers per request (lengths, for percentiles) and a few bytes per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.traces.blocks import BlockIndex, GrowArray
from kvtier.traces.formats import DEFAULT_BLOCK_TOKENS, TraceFormat, TraceReader
from kvtier.traces.radix import PrefixTree
from kvtier.traces.sessions import SessionTracker

PERCENTILES = (50, 90, 99)
REPETITION_TOKENS = (512, 2048, 8192, 32768)
REPETITION_COUNTS = (2, 5, 10, 100)


def _progress(reader: TraceReader, enabled: bool, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=reader.total_bytes,
        unit="B",
        unit_scale=True,
        desc=desc,
        disable=None if enabled else True,
        leave=False,
    )


def distribution(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": 0.0, "max": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    out = {"mean": float(values.mean())}
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(values, q))
    out["max"] = float(values.max())
    return out


def analyze_file(
    path: Path | str,
    fmt: TraceFormat | str = TraceFormat.AUTO,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    progress: bool = False,
    repetition_tokens: Sequence[int] = REPETITION_TOKENS,
    repetition_counts: Sequence[int] = REPETITION_COUNTS,
) -> dict[str, Any]:
    reader = TraceReader(path, fmt, block_tokens)
    bar = _progress(reader, progress, "analyze")
    last = 0

    def tick(reqs: Iterable) -> Iterable:
        nonlocal last
        for req in reqs:
            yield req
            if reader.bytes_read - last > 1 << 20:
                bar.update(reader.bytes_read - last)
                last = reader.bytes_read

    try:
        report = analyze(
            tick(reader),
            block_tokens,
            derive_sessions=reader.format is TraceFormat.MOONCAKE,
            repetition_tokens=repetition_tokens,
            repetition_counts=repetition_counts,
        )
    finally:
        bar.close()
    report["trace"] = {"path": str(path), "format": str(reader.format)}
    return report


def analyze(
    requests: Iterable,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    derive_sessions: bool,
    repetition_tokens: Sequence[int] = REPETITION_TOKENS,
    repetition_counts: Sequence[int] = REPETITION_COUNTS,
) -> dict[str, Any]:
    index = BlockIndex()
    tree = PrefixTree(index)
    sessions = SessionTracker(tree, block_tokens, derive=derive_sessions)
    inputs = GrowArray(np.int64)
    outputs = GrowArray(np.int64)
    session_tokens = GrowArray(np.int64)
    session_turns = GrowArray(np.int32)
    n = 0
    first_ts = last_ts = 0.0
    total_blocks = hit_blocks = intra_blocks = hit_tokens = requests_hit = 0
    for req in requests:
        slots = index.slots(req.hash_ids)
        obs = sessions.observe(req, slots)
        if n == 0:
            first_ts = req.timestamp
        last_ts = req.timestamp
        inputs.ensure(n + 1)[n] = req.input_length
        outputs.ensure(n + 1)[n] = req.output_length
        session_tokens.ensure(obs.session + 1)[obs.session] += req.input_length + req.output_length
        session_turns.ensure(obs.session + 1)[obs.session] += 1
        n += 1
        total_blocks += len(slots)
        hit_blocks += obs.hit_blocks
        intra_blocks += obs.intra_blocks
        hit_tokens += min(obs.hit_blocks * block_tokens, req.input_length)
        requests_hit += obs.hit_blocks > 0

    ins = inputs.data[:n]
    outs = outputs.data[:n]
    input_total = int(ins.sum())
    output_total = int(outs.sum())
    n_sessions = sessions.sessions
    turns = session_turns.data[:n_sessions]
    tokens = np.sort(session_tokens.data[:n_sessions])[::-1]
    return {
        "block_tokens": block_tokens,
        "requests": n,
        "duration_ms": last_ts - first_ts,
        "input_tokens": {"total": input_total, **distribution(ins)},
        "output_tokens": {"total": output_total, **distribution(outs)},
        "prefill_token_share": _ratio(input_total, input_total + output_total),
        "blocks_per_request_mean": _ratio(total_blocks, n),
        "blocks": {"unique": sessions.distinct_blocks, "total": total_blocks},
        "infinite_cache": {
            "hit_ratio_blocks": _ratio(hit_blocks, total_blocks),
            "hit_ratio_tokens": _ratio(hit_tokens, input_total),
            "requests_with_hit": _ratio(requests_hit, n),
            "hit_blocks": hit_blocks,
            "hit_tokens": hit_tokens,
        },
        "sessions": {
            "rule": sessions.rule,
            "count": n_sessions,
            "single_turn_share": _ratio(int(np.count_nonzero(turns == 1)), n_sessions),
            "turns_mean": _ratio(n, n_sessions),
            "turns_max": int(turns.max()) if n_sessions else 0,
            "top5_token_share": _ratio(int(tokens[:5].sum()), input_total + output_total),
            "intra_session_hit_share": _ratio(intra_blocks, hit_blocks),
            "cross_session_hit_share": _ratio(hit_blocks - intra_blocks, hit_blocks),
        },
        "prefix_repetition": {
            "definition": (
                "distinct radix-tree prefixes of >= L tokens (whole blocks) that begin >= N "
                "requests; a chain of blocks shared by the same requests counts once"
            ),
            "rows": [
                {"min_tokens": row.min_tokens, "counts": row.counts}
                for row in tree.repetition(block_tokens, repetition_tokens, repetition_counts)
            ],
            "top": [{"tokens": t, "requests": c} for t, c in tree.top_prefixes(block_tokens, 5)],
            "inconsistent_blocks": tree.inconsistent,
        },
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
