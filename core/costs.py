"""What each tier's hit saves of a recompute, by prompt length: the cost table the router
prices candidates with and the connector decides whether a slow tier is worth reading.

kappa = (t_miss - t_tier) / (t_miss - t_gpu): 1 when a hit costs what a GPU hit costs, 0 when
it costs what recomputing costs (a tier slower than recompute is held at 0, never negative).
``kvtier bench tier-latency --kappa-out FILE`` measures it on the deployment's hardware
(``{"dram": {"1024": 0.6, ...}, "remote": {...}, "disk": {...}}``); the defaults are the
reference tier latencies (../shared/docs/router-anchors.md) and know no disk.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Self

DEFAULT_KAPPA: Mapping[str, Mapping[int, float]] = {
    "dram": {1024: 0.58, 8192: 0.96, 32768: 0.98},
    "remote": {1024: 0.47, 8192: 0.82, 32768: 0.87},
}


class KappaTable:
    """kappa per tier, interpolated in log(length) between measured points and held flat
    beyond them; a tier the table does not name has kappa 0 (priced as a recompute)."""

    def __init__(self, kappa: Mapping[str, Mapping[int, float]] | None = None) -> None:
        table = kappa if kappa is not None else DEFAULT_KAPPA
        self._points: dict[str, tuple[list[float], list[float]]] = {}
        for tier, points in table.items():
            lengths = sorted(points)
            if not lengths or lengths[0] <= 0:
                raise ValueError(f"kappa[{tier}]: lengths must be positive")
            values = [min(1.0, max(0.0, points[n])) for n in lengths]
            self._points[tier] = ([math.log(n) for n in lengths], values)

    @classmethod
    def from_file(cls, path: Path | None) -> Self:
        """The table in ``path`` (JSON, lengths as strings), or the defaults for None."""
        if path is None:
            return cls()
        table = json.loads(Path(path).read_text())
        return cls(
            {tier: {int(n): float(k) for n, k in pts.items()} for tier, pts in table.items()}
        )

    def knows(self, tier: str) -> bool:
        return tier in self._points

    def kappa(self, tier: str, tokens: int) -> float:
        points = self._points.get(tier)
        if points is None:
            return 0.0
        xs, ys = points
        x = math.log(max(tokens, 1))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])
