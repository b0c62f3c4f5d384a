"""Timing helper shared by the microbenchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int, warmup: int = 0) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn``, after ``warmup`` untimed calls
    (page faults, allocator growth). The minimum, not the mean: on a shared machine noise only
    ever adds time."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
