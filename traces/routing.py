"""Routing in the cluster simulator: the router's own policies over the simulator's state.

The policies are ``kvtier.router.policies`` (``make_policy``, ``POLICIES``), the classes the
router serves with, so a policy tuned here is deployed unchanged. This module only adapts:
for each request it turns the simulator's cluster state into one ``Candidate`` per instance,
in instance order, and maps ``Decision.index`` back to the instance.

- **Load**: ``pending_prefill_tokens`` = the instance's prefill backlog (time until its
  prefill queue drains x the modelled prefill rate); ``running`` = requests not yet finished
  (prefilling or decoding). ``waiting`` and ``kv_usage`` are not modelled (0).
- **Coverage** (cumulative, in tokens, capped at the prompt length): ``gpu`` = the
  instance's GPU leading run; ``dram`` = that plus the run that follows in its node's DRAM
  pool; ``remote`` = that plus the run that follows in other nodes' pools (only when the
  simulator models a remote tier: several nodes with DRAM, remote on). These are exactly the
  runs the request would then be served from (``ClusterSim.step``), read without touching
  any cache. Blocks become tokens at ``block_tokens`` each.
- **Sessions**: the simulator's integer session id, as a string.

Instances are named ``i0``, ``i1``, ... zero-padded to a common width, so the policies'
tie-break by name is the instance order. Cache-blind policies (round-robin, least-load,
sticky) get no coverage: it is not computed (it costs a lookup per instance).

The router's seven policies take a faster road to the same decisions (fastroute.py): scored
over numpy arrays of the whole fleet, with only the best-tied instances handed to the policy as
``Candidate``s. ``candidates`` builds the full list, which any other policy gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvtier.router.policies import (
    POLICIES,
    Candidate,
    Coverage,
    Decision,
    LeastLoad,
    Load,
    Policy,
    RoundRobin,
    RouteRequest,
    Sticky,
    TierCosts,
    make_policy,
)
from kvtier.traces.fastroute import FastChooser

__all__ = [
    "POLICIES",
    "ClusterView",
    "SimRouter",
    "coverage_from_blocks",
    "make_policy",
    "make_sim_router",
]

_CACHE_BLIND = (RoundRobin, LeastLoad, Sticky)


class ClusterView(Protocol):
    @property
    def size(self) -> int: ...

    def tier_runs(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """Per instance: the leading blocks of ``ids`` in its GPU cache, then the run that
        follows in its node's pool, then the run that follows in other nodes' pools."""
        ...

    def loads(self, now: float) -> list[tuple[float, int]]:
        """Per instance: (pending prefill tokens, running requests) at ``now``."""
        ...

    def load_arrays(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """``loads`` as two arrays: pending prefill tokens (float64), running (int64)."""
        ...

    def tier_run_arrays(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``tier_runs`` as three int64 arrays: GPU, node pool and remote runs."""
        ...


def coverage_from_blocks(runs: tuple[int, int, int], tokens: int, block_tokens: int) -> Coverage:
    """Cumulative token coverage from block runs (GPU, then node DRAM, then remote)."""
    g, d, r = runs
    return Coverage(
        gpu=min(g * block_tokens, tokens),
        dram=min((g + d) * block_tokens, tokens),
        remote=min((g + d + r) * block_tokens, tokens),
    )


class SimRouter:
    """A policy applied to the simulator, one request at a time in arrival order.

    ``fast`` (default): the router's own policies decide through ``FastChooser``; False
    builds every candidate (the general path, which other policies always take)."""

    def __init__(
        self, policy: Policy, instances: int, block_tokens: int, *, fast: bool = True
    ) -> None:
        self.policy = policy
        self.block_tokens = block_tokens
        width = len(str(max(instances - 1, 0)))
        self.names = [f"i{i:0{width}d}" for i in range(instances)]
        self.uses_coverage = not isinstance(policy, _CACHE_BLIND)
        self._fast = (
            FastChooser(policy, self.names, block_tokens)
            if fast and FastChooser.supports(policy)
            else None
        )

    def candidates(
        self, view: ClusterView, ids: Sequence[int], tokens: int, now: float
    ) -> list[Candidate]:
        loads = view.loads(now)
        if not self.uses_coverage:
            return [
                Candidate(name, Load(pending, running))
                for name, (pending, running) in zip(self.names, loads, strict=True)
            ]
        bt = self.block_tokens
        return [
            Candidate(name, Load(pending, running), coverage_from_blocks(runs, tokens, bt))
            for name, (pending, running), runs in zip(
                self.names, loads, view.tier_runs(ids), strict=True
            )
        ]

    def choose(
        self, view: ClusterView, ids: Sequence[int], tokens: int, session: int | None, now: float
    ) -> Decision:
        """The policy's decision; its ``index`` is the instance."""
        spread = f"{len(ids)}:{ids[-1]}" if ids else None  # the last block names the prompt
        request = RouteRequest(tokens, None if session is None else str(session), spread)
        if self._fast is not None:
            return self._fast.choose(view, ids, request, now)
        return self.policy.choose(request, self.candidates(view, ids, tokens, now))


def make_sim_router(
    name: str,
    instances: int,
    block_tokens: int,
    dram_credit: float = 0.5,
    costs: TierCosts | None = None,
) -> SimRouter:
    """``make_policy(name, ...)`` wrapped for the simulator (unknown names raise ValueError)."""
    return SimRouter(make_policy(name, dram_credit, costs), instances, block_tokens)
