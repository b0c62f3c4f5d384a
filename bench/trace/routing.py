"""Routing policies for the cluster simulator: which instance serves a request.

A router sees the cluster through ``ClusterView`` (read-only) and is called once per request, in
arrival order, from one thread. It may keep its own state (a session table).

- ``round-robin``: instances in turn; ignores caches.
- ``sticky``: a session stays where its first turn went (the least loaded instance then).
- ``cache-aware``: the instance holding the longest prefix (GPU, then its node's DRAM), ties
  broken by load. Affinity alone: one hot shared prefix can pile everything onto one instance.
- ``lmetric``: score = (pending prefill tokens + this request's uncached tokens) x (running
  requests + 1), lowest wins. Counting only uncached tokens gives a soft affinity without an
  explicit one (the reference's LMetric; +1 so that idle instances still compare by work).

Both cache-aware policies weigh a block found in the node's DRAM by ``dram_credit`` (GPU = 1):
loading from DRAM is cheap but not free, and with a credit of 1 a router happily leaves the
instance whose GPU holds the prefix for any instance on the same node.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol


class ClusterView(Protocol):
    @property
    def size(self) -> int: ...

    def cached_blocks(self, instance: int, ids: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of ``ids`` in the instance's GPU cache, then in its node's DRAM."""
        ...

    def pending_prefill_tokens(self, instance: int, now: float) -> float: ...

    def running(self, instance: int, now: float) -> int: ...


class Router(abc.ABC):
    name: str

    @abc.abstractmethod
    def choose(
        self, view: ClusterView, ids: Sequence[int], input_length: int, session: int, now: float
    ) -> int: ...


def _load(view: ClusterView, i: int, now: float) -> tuple[float, int]:
    return view.pending_prefill_tokens(i, now), view.running(i, now)


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, view: ClusterView, ids: Sequence[int], input_length: int, session: int, now: float
    ) -> int:
        i = self._next % view.size
        self._next += 1
        return i


class SessionSticky(Router):
    name = "sticky"

    def __init__(self) -> None:
        self._home: dict[int, int] = {}

    def choose(
        self, view: ClusterView, ids: Sequence[int], input_length: int, session: int, now: float
    ) -> int:
        home = self._home.get(session)
        if home is None:
            home = min(range(view.size), key=lambda i: (_load(view, i, now), i))
            self._home[session] = home
        return home


class CacheAware(Router):
    name = "cache-aware"

    def __init__(self, dram_credit: float) -> None:
        self.dram_credit = dram_credit

    def choose(
        self, view: ClusterView, ids: Sequence[int], input_length: int, session: int, now: float
    ) -> int:
        def key(i: int) -> tuple[float, tuple[float, int], int]:
            gpu, dram = view.cached_blocks(i, ids)
            return (-(gpu + self.dram_credit * dram), _load(view, i, now), i)

        return min(range(view.size), key=key)


class LMetric(Router):
    name = "lmetric"

    def __init__(self, block_tokens: int, dram_credit: float) -> None:
        self.block_tokens = block_tokens
        self.dram_credit = dram_credit

    def choose(
        self, view: ClusterView, ids: Sequence[int], input_length: int, session: int, now: float
    ) -> int:
        best, best_key = 0, None
        for i in range(view.size):
            gpu, dram = view.cached_blocks(i, ids)
            cached = min((gpu + self.dram_credit * dram) * self.block_tokens, input_length)
            pending, running = _load(view, i, now)
            score = (pending + input_length - cached) * (running + 1)
            key = (score, -cached, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best


ROUTERS = ("round-robin", "sticky", "cache-aware", "lmetric")


def make_router(name: str, block_tokens: int, dram_credit: float = 0.5) -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "sticky":
        return SessionSticky()
    if name == "cache-aware":
        return CacheAware(dram_credit)
    if name == "lmetric":
        return LMetric(block_tokens, dram_credit)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTERS)}")
