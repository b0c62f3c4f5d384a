"""``kvtier trace sample``: a smaller trace that keeps the reuse structure of the original.

1. **Window**: sessions whose first request falls in ``[start, start + window)`` are
   candidates; a candidate keeps all its turns, even those after the window (whole sessions).
2. **Thinning** to ``sample_ratio`` of the candidate sessions, by *prefix group* (sessions whose
   first block is the same: a shared system prompt or document). Thinning sessions one by one
   would cut cross-session sharing (a prefix shared by m sessions gives m-1 hits, by p*m
   sessions p*m-1), so a group too small to keep ``MIN_THINNED_GROUP`` sessions after thinning
   is kept or dropped whole, with probability ``sample_ratio``; larger groups are thinned
   inside, keeping sharing nearly intact.
3. **Single-turn cap**: while single-turn sessions exceed ``max_single_turn_ratio`` of the kept
   sessions, drop single-turn sessions, those that share nothing first.

The output is in the session format (sessions named; derived for a Mooncake trace, see
sessions.py), timestamps shifted so the window starts at 0. The report gives the reuse figures
of the whole trace, of the window and of the sample, so what sampling did is visible.

Memory: 4 bytes per request, a few per session; the input is read four times.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.analyze import analyze
from kvtier.traces.blocks import GrowArray
from kvtier.traces.formats import (
    DEFAULT_BLOCK_TOKENS,
    TraceFormat,
    TraceReader,
    TraceRequest,
    TraceWriter,
)
from kvtier.traces.sessions import DERIVED_SESSIONS_RULE, SessionTracker

MIN_THINNED_GROUP = 5


@dataclass(frozen=True)
class SampleOptions:
    window_seconds: float | None = None  # None: the whole trace
    window_start_seconds: float | None = None  # None: drawn with the seed
    sample_ratio: float = 1.0
    max_single_turn_ratio: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.sample_ratio <= 1:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "sample ratio must be in (0, 1]")
        if not 0 <= self.max_single_turn_ratio <= 1:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "max single-turn ratio must be in [0, 1]")
        if self.window_seconds is not None and self.window_seconds <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "window must be > 0 seconds")


class _Labels:
    """Pass 1: the session and turn of every request, and a row per session."""

    def __init__(self, reader: TraceReader) -> None:
        self.reader = reader
        self.explicit = reader.format is TraceFormat.SESSION
        tracker = SessionTracker.standalone(reader.block_tokens, derive=not self.explicit)
        session = GrowArray(np.int32)
        turn = GrowArray(np.int32)
        first_ts = GrowArray(np.float64)
        turns = GrowArray(np.int32)
        root = GrowArray(np.int64, -1)
        names: list[str] = []
        n = 0
        self.first_ts = self.last_ts = 0.0
        for req in reader:
            obs = tracker.observe(req)
            session.ensure(n + 1)[n] = obs.session
            turn.ensure(n + 1)[n] = obs.turn
            if obs.new_session:
                s = obs.session
                first_ts.ensure(s + 1)[s] = req.timestamp
                root.ensure(s + 1)[s] = req.hash_ids[0] if req.hash_ids else -1 - s
                names.append(req.session_id if self.explicit else f"d{s}")  # type: ignore[arg-type]
            turns.ensure(obs.session + 1)[obs.session] += 1
            if n == 0:
                self.first_ts = req.timestamp
            self.last_ts = req.timestamp
            n += 1
        self.requests = n
        self.sessions = tracker.sessions
        self.session = session.data[:n]
        self.turn = turn.data[:n]
        self.session_first_ts = first_ts.data[: self.sessions]
        self.session_turns = turns.data[: self.sessions]
        self.session_root = root.data[: self.sessions]
        self.names = names

    def labelled(
        self, keep: np.ndarray | None = None, shift_ms: float = 0.0
    ) -> Iterator[TraceRequest]:
        """Pass 2+: the requests again, named, optionally only kept sessions, shifted."""
        for i, req in enumerate(self.reader):
            s = int(self.session[i])
            if keep is not None and not keep[s]:
                continue
            yield msgspec.structs.replace(
                req,
                session_id=self.names[s],
                turn=int(self.turn[i]),
                timestamp=req.timestamp - shift_ms,
            )


def choose_sessions(labels: _Labels, opts: SampleOptions) -> tuple[np.ndarray, np.ndarray, float]:
    """(window mask, kept mask, window start in ms) over sessions."""
    rng = random.Random(opts.seed)
    first = labels.session_first_ts
    start_ms = labels.first_ts
    if opts.window_seconds is None:
        window = np.ones(labels.sessions, dtype=bool)
    else:
        span_ms = opts.window_seconds * 1000.0
        if opts.window_start_seconds is not None:
            start_ms = labels.first_ts + opts.window_start_seconds * 1000.0
        else:
            latest = max(labels.first_ts, labels.last_ts - span_ms)
            start_ms = labels.first_ts + rng.random() * (latest - labels.first_ts)
        window = (first >= start_ms) & (first < start_ms + span_ms)

    keep = np.zeros(labels.sessions, dtype=bool)
    groups: dict[int, list[int]] = {}
    for s in np.flatnonzero(window):
        groups.setdefault(int(labels.session_root[s]), []).append(int(s))
    p = opts.sample_ratio
    for members in groups.values():  # dict order = first appearance: deterministic
        if p >= 1:
            keep[members] = True
        elif len(members) * p >= MIN_THINNED_GROUP:
            keep[rng.sample(members, round(len(members) * p))] = True
        elif rng.random() < p:
            keep[members] = True

    single = keep & (labels.session_turns == 1)
    n_single, kept, cap = int(single.sum()), int(keep.sum()), opts.max_single_turn_ratio
    if n_single > cap * kept:
        # Dropping x single-turn sessions of k kept: (s - x) / (k - x) <= r  <=>
        # x >= (s - r k) / (1 - r); r < 1 here, since s > r k and s <= k.
        need = min(n_single, int(np.ceil((n_single - cap * kept) / (1 - cap) - 1e-9)))
        group_kept: dict[int, int] = {}
        for s in np.flatnonzero(keep):
            root = int(labels.session_root[s])
            group_kept[root] = group_kept.get(root, 0) + 1
        candidates = [int(s) for s in np.flatnonzero(single)]
        rng.shuffle(candidates)
        candidates.sort(key=lambda s: group_kept[int(labels.session_root[s])] > 1)
        keep[candidates[:need]] = False
    return window, keep, start_ms


def sample_file(
    path: Path | str,
    out: Path | str,
    opts: SampleOptions,
    fmt: TraceFormat | str = TraceFormat.AUTO,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> dict[str, Any]:
    reader = TraceReader(path, fmt, block_tokens)
    labels = _Labels(reader)
    window, keep, start_ms = choose_sessions(labels, opts)
    written = 0
    with TraceWriter(out, TraceFormat.SESSION) as writer:
        for req in labels.labelled(keep, shift_ms=start_ms):
            writer.write(req)
            written += 1

    def figures(report: dict[str, Any]) -> dict[str, Any]:
        s = report["sessions"]
        return {
            "requests": report["requests"],
            "sessions": s["count"],
            "single_turn_share": s["single_turn_share"],
            "turns_mean": s["turns_mean"],
            "input_tokens_mean": report["input_tokens"]["mean"],
            "input_tokens_p50": report["input_tokens"]["p50"],
            "hit_ratio_blocks": report["infinite_cache"]["hit_ratio_blocks"],
            "hit_ratio_tokens": report["infinite_cache"]["hit_ratio_tokens"],
            "intra_session_hit_share": s["intra_session_hit_share"],
            "cross_session_hit_share": s["cross_session_hit_share"],
            "duration_s": report["duration_ms"] / 1000.0,
        }

    def stats(mask: np.ndarray | None) -> dict[str, Any]:
        return figures(analyze(labels.labelled(mask), block_tokens, derive_sessions=False))

    return {
        "input": str(path),
        "output": str(out),
        "options": {
            "window_seconds": opts.window_seconds,
            "window_start_seconds": (start_ms - labels.first_ts) / 1000.0,
            "sample_ratio": opts.sample_ratio,
            "max_single_turn_ratio": opts.max_single_turn_ratio,
            "seed": opts.seed,
        },
        "sessions_rule": (
            "sessions as named by the trace" if labels.explicit else DERIVED_SESSIONS_RULE
        ),
        "written_requests": written,
        "figures": {"trace": stats(None), "window": stats(window), "sample": stats(keep)},
    }
