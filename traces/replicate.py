"""Scale a trace's load up: K copies of it as distinct users, optionally time-compressed.

``Replication(copies=K, spread_ms=S, time_scale=T)`` turns a trace into K copies merged in
timestamp order, so the arrival rate is K / T times the original's:

- **Distinct users**: copy c's hash ids become ``id * K + c`` (a bijection, so the copies share
  no block, and no maximum id has to be known in advance: the stream stays a stream), and a
  session-format copy's ``session_id`` gets ``#c`` appended. This is conservative for cache hit
  ratios: a real fleet's users share system prompts and documents across the copies' borders.
- **Staggered**: copy c is delayed by ``c * S / K`` ms, so each original request becomes K
  arrivals spread evenly over S ms instead of a burst of K at one instant.
- **Time scale**: every timestamp is multiplied by T first (T < 1 compresses: the same users
  ask T times as fast, which raises load without adding users; their reuse then also comes
  sooner, which flatters hit ratios, so replication is the honest way to add load).

The merge is streaming: copies of request j have timestamps in [t_j, t_j + S), so once the
input reaches t, every buffered copy before t can go; the buffer holds the copies of about
S ms of trace. The input must be in timestamp order (``TraceReader`` enforces it); the output
then is too, ties broken by copy, then by input order. ``copies=1, time_scale=1`` passes the
input through unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from kvtier.traces.formats import TraceRequest


@dataclass(frozen=True)
class Replication:
    copies: int = 1  # K: distinct-user copies of the trace
    spread_ms: float = 1000.0  # S: copy c is delayed by c * S / K ms
    time_scale: float = 1.0  # T: timestamps x T before the copies are made (< 1 compresses)

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError("copies must be >= 1")
        if self.spread_ms < 0:
            raise ValueError("spread_ms must be >= 0")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")

    @property
    def identity(self) -> bool:
        return self.copies == 1 and self.time_scale == 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def apply(self, requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
        """The replicated stream (see the module docstring)."""
        if self.identity:
            yield from requests
            return
        k, scale = self.copies, self.time_scale
        stagger = self.spread_ms / k
        # (timestamp, copy, input order, request): the order of a stable K-way merge.
        pending: list[tuple[float, int, int, TraceRequest]] = []
        for order, req in enumerate(requests):
            base = req.timestamp * scale
            while pending and pending[0][0] < base:
                yield heapq.heappop(pending)[3]
            for c in range(k):
                at = base + c * stagger
                heapq.heappush(pending, (at, c, order, _copy(req, k, c, at)))
        while pending:
            yield heapq.heappop(pending)[3]


def _copy(req: TraceRequest, k: int, c: int, at_ms: float) -> TraceRequest:
    return msgspec.structs.replace(
        req,
        timestamp=at_ms,
        hash_ids=[h * k + c for h in req.hash_ids] if k > 1 else req.hash_ids,
        session_id=None if req.session_id is None or k == 1 else f"{req.session_id}#{c}",
    )
