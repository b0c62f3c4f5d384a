"""The router's policies over a whole fleet at numpy speed, with the same decisions.

``SimRouter`` (routing.py) hands a policy one ``Candidate`` per instance. At 1,000 instances,
building them and scoring each in Python (the rendezvous hash of every candidate included)
costs milliseconds per request, most of a fleet-scale simulation. ``FastChooser`` gets the same
decision another way, for the seven policies of ``kvtier.router.policies`` (their exact
classes; anything else, subclasses included, takes the general path):

1. it computes, over numpy arrays of every instance's load and coverage, the key the policy
   minimises, except its last part (the rendezvous-hash tie-break), with the same floating
   point operations in the same order, so the values are bitwise those of the policy;
2. it keeps the instances whose key ties for the best and, when several do (idle instances
   and a cold prompt: 80-140 of a 1,000-instance fleet at 36 % prefill load), the one the
   policies' last tie-break prefers (``_spread``: the rendezvous hash of the request's tie key
   and the name, then the name; mirrored in ``rendezvous``, whose hashes are computed from one
   prefix state, half the cost), plus whatever else the policy looks at (kvtier: the GPU
   holder);
3. it lets the policy itself choose among those one or two candidates, so the gates and the
   reasons stay the policy's own code.

Where a policy compares against the average load of *all* candidates (sticky's and hybrid's
overload test), the rest of its ``choose`` is mirrored here over the full arrays (sticky keeps
its session table here, as ``Sticky`` does). ``Decision.scores`` is left empty: the simulator
reads only ``index`` and ``reason``.

tests/unit/traces/test_fleet.py runs this and a reference (every candidate through the policy,
every cache asked in turn) over trace samples and asserts identical reports; it fails the day a
policy's formula changes without this module following.

Not thread-safe (sticky's session table).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvtier.router.policies import (
    CacheAware,
    Candidate,
    Coverage,
    Decision,
    Hybrid,
    Kvtier,
    LeastLoad,
    LMetric,
    Load,
    Policy,
    RoundRobin,
    RouteRequest,
    Sticky,
)

_SUPPORTED = (RoundRobin, LeastLoad, Sticky, CacheAware, LMetric, Hybrid, Kvtier)

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


class ArrayView(Protocol):
    def load_arrays(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per instance: pending prefill tokens (float64), running requests (int64)."""
        ...

    def tier_run_arrays(self, ids: Sequence[int]) -> Arrays:
        """Per instance (int64): leading GPU run, then node pool run, then remote run."""
        ...


def _tied(*keys: np.ndarray) -> np.ndarray:
    """Indices whose keys tie for the lexicographic minimum (ascending)."""
    idx = np.flatnonzero(keys[0] == keys[0].min())
    for key in keys[1:]:
        if len(idx) == 1:
            break
        k = key[idx]
        idx = idx[k == k.min()]
    return idx


def rendezvous(tie_key: str | None, names: Sequence[bytes], idx: Sequence[int]) -> int:
    """The one of ``idx`` that ``kvtier.router.policies._spread`` ranks first: the least
    ``int.from_bytes(blake2b(f"{tie_key}\\0{name}", 8 bytes), "little")``, then the least name
    (``names``: UTF-8, sorted like the indices); with no tie key, the least name."""
    if tie_key is None:
        return min(idx)
    copy = hashlib.blake2b(f"{tie_key}\0".encode(), digest_size=8).copy

    def rank(i: int) -> tuple[bytes, int]:
        h = copy()
        h.update(names[i])
        return h.digest()[::-1], i  # reversed little-endian bytes sort as the integer

    return min(map(rank, idx))[1]


def _overloaded(i: int, pending: np.ndarray, running: np.ndarray, factor: float) -> bool:
    """``kvtier.router.policies._overloaded`` over the arrays (Python sums, as it does, so the
    rounding is the same)."""
    pend = pending.tolist()
    total = sum(pend)
    if total > 0:
        return bool(pend[i] > factor * (total / len(pend)))
    run = running.tolist()
    total_running = sum(run)
    return total_running > 0 and run[i] > factor * (total_running / len(run))


class FastChooser:
    """``policy.choose`` over every instance of an ``ArrayView``, at numpy speed."""

    def __init__(self, policy: Policy, names: Sequence[str], block_tokens: int) -> None:
        if not self.supports(policy):
            raise ValueError(f"no fast path for {type(policy).__name__}")
        self.policy = policy
        self.names = list(names)
        self.block_tokens = block_tokens
        self._named = [Candidate(name) for name in self.names]  # round-robin reads their count
        self._name_bytes = [name.encode() for name in self.names]
        self._least = LeastLoad()
        self._home: OrderedDict[str, int] = OrderedDict()  # sticky: session -> instance

    @staticmethod
    def supports(policy: Policy) -> bool:
        return type(policy) in _SUPPORTED

    def choose(
        self, view: ArrayView, ids: Sequence[int], request: RouteRequest, now: float
    ) -> Decision:
        policy = self.policy
        kind = type(policy)
        pending, running = view.load_arrays(now)  # also retires finished requests
        if kind is RoundRobin:
            return policy.choose(request, self._named)
        if kind is LeastLoad:
            idx = self._spread(request, _tied(pending, running))
            return self._among(policy, request, idx, pending, running)
        if isinstance(policy, Sticky):
            return self._sticky(policy, request, pending, running)
        tokens = request.tokens
        gpu, dram, remote = view.tier_run_arrays(ids)
        bt = self.block_tokens
        cov = (
            np.minimum(gpu * bt, tokens),
            np.minimum((gpu + dram) * bt, tokens),
            np.minimum((gpu + dram + remote) * bt, tokens),
        )
        cg, cd, cr = cov
        if isinstance(policy, CacheAware):
            cached = cg + policy.dram_credit * (cd - cg)
            idx = self._spread(request, _tied(-cached, pending, running))
            return self._among(policy, request, idx, pending, running, cov)
        if isinstance(policy, Kvtier):
            kd = policy.costs.kappa("dram", tokens)
            kr = policy.costs.kappa("remote", tokens)
            uncached = (cd - cg) * (1 - kd) + (cr - cd) * (1 - kr) + (tokens - cr)
            score = (pending + uncached) * (running + 1)
            best = int(self._spread(request, _tied(score, -cg, pending, running))[0])
            holder = int(np.argmax(cg))  # the first instance with the longest GPU run
            idx = np.array(sorted({best, holder}))
            return self._among(policy, request, idx, pending, running, cov)
        assert isinstance(policy, LMetric)  # or Hybrid, its subclass
        uncached = (tokens - cg) - policy.dram_credit * (cd - cg)
        score = (pending + uncached) * (running + 1)
        idx = self._spread(request, _tied(score, uncached, pending, running))
        base = self._among(policy, request, idx, pending, running, cov, as_lmetric=True)
        if not isinstance(policy, Hybrid):
            return base
        # Hybrid's affinity gate, over all instances.
        holder = int(np.argmax(cg))
        if (
            int(cg[holder]) > policy.affinity * tokens
            and holder != base.index
            and not _overloaded(holder, pending, running, policy.overload_factor)
        ):
            return Decision(holder, "affinity")
        return base

    def _spread(self, request: RouteRequest, idx: np.ndarray) -> np.ndarray:
        """Of instances tied on everything else, the one the policies' tie-break picks."""
        if len(idx) <= 1:
            return idx
        return np.array([rendezvous(request.tie_key, self._name_bytes, idx.tolist())])

    def _among(
        self,
        policy: Policy,
        request: RouteRequest,
        idx: np.ndarray,
        pending: np.ndarray,
        running: np.ndarray,
        cov: Arrays | None = None,
        *,
        as_lmetric: bool = False,
    ) -> Decision:
        """The policy's own choice among the instances ``idx``, as an instance index
        (``as_lmetric``: hybrid's base choice, ``LMetric.choose``, before its gate)."""
        names = self.names
        order = idx.tolist()
        loads = [
            Load(p, r) for p, r in zip(pending[idx].tolist(), running[idx].tolist(), strict=True)
        ]
        if cov is None:
            cands = [Candidate(names[i], load) for i, load in zip(order, loads, strict=True)]
        else:
            cg, cd, cr = (c[idx].tolist() for c in cov)
            cands = [
                Candidate(names[i], load, Coverage(g, d, r))
                for i, load, g, d, r in zip(order, loads, cg, cd, cr, strict=True)
            ]
        if as_lmetric:
            assert isinstance(policy, LMetric)
            decision = LMetric.choose(policy, request, cands)
        else:
            decision = policy.choose(request, cands)
        return Decision(order[decision.index], decision.reason)

    def _sticky(
        self, policy: Sticky, request: RouteRequest, pending: np.ndarray, running: np.ndarray
    ) -> Decision:
        """``Sticky.choose`` with its session table here (instances, not names: the
        simulator's instances never go away, so a home is always among the candidates)."""
        idx = self._spread(request, _tied(pending, running))
        least = self._among(self._least, request, idx, pending, running)
        session = request.session
        if session is None:
            return Decision(least.index, "no-session")
        home = self._home.get(session)
        reason = "new-session"
        if home is not None:
            if not _overloaded(home, pending, running, policy.overload_factor):
                self._home.move_to_end(session)
                return Decision(home, "sticky")
            reason = "overloaded"
        self._home[session] = least.index
        self._home.move_to_end(session)
        while len(self._home) > policy.max_sessions:
            self._home.popitem(last=False)
        return Decision(least.index, reason)
