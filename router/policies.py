"""Routing policies: which instance serves a request. One implementation, two users: the
router (``kvtier router serve``, ``kvtier router epp``) and the trace simulator (``kvtier
trace simulate``), so a policy tuned on traces is deployed unchanged.

A policy sees each request as ``RouteRequest`` (its length in tokens, its session) and the
instances it may use as ``Candidate``s: their load and how much of the prompt each can read
from where (``Coverage``, cumulative by tier). It returns a ``Decision`` naming one of them,
why, and every candidate's score (for the decision log).

- ``round-robin``: in turn, blind to caches and load.
- ``least-load``: fewest pending prefill tokens, then fewest running requests.
- ``sticky``: a session stays where its first turn went, unless that instance's load exceeds
  ``overload_factor`` (2) x the average: then it moves to the least loaded one.
- ``cache-aware``: the longest cached prefix (GPU, DRAM at ``dram_credit``), ties by load.
  Affinity alone: a hot shared prefix piles everything onto one instance.
- ``lmetric``: score = (pending prefill tokens + this request's uncached tokens) x (running
  requests + 1), lowest wins. Counting only uncached tokens is a soft affinity.
- ``hybrid``: lmetric, plus an affinity gate: stay on the instance whose GPU holds more than
  half the prompt unless it is overloaded (load > ``overload_factor`` x average).
- ``kvtier``: lmetric where a token costs what loading it from its cheapest tier costs: 0 in
  the instance's GPU, (1 - kappa) of a recompute in its node's DRAM, its node's disk or
  another node's pool, with kappa measured per tier and length (``TierCosts``; the default
  table knows no disk, which then costs a recompute). A prefix in any node store is warm
  everywhere, so load decides and a shared system prompt stops being a hot spot; leaving the
  GPU holder costs a fetch, not a recompute, and the gate compares exactly that.

Exact ties (same score, same coverage, same load: idle instances and a cold prompt, the
common case at low load) break by rendezvous hashing on the request's ``spread_key`` (its
session, else its first chunk), then by name: cold sessions spread evenly over the instances
instead of all landing on the first name, a session's cold turns keep meeting the same
instance, and replicas of the router still agree because nothing depends on their history.
Not thread-safe: a router calls a policy from one thread (or under a lock); ``sticky`` keeps a
session table.
"""

from __future__ import annotations

import abc
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.costs import KappaTable


@dataclass(frozen=True)
class Coverage:
    """Leading tokens of the prompt an instance can read without recomputing, cumulative:
    ``gpu`` from its own GPU cache, ``dram`` from that or its node's DRAM pool (>= gpu),
    ``disk`` from those or its node's disk (0: none beyond DRAM), ``remote`` from those or any
    other node's pool (>= dram and >= disk)."""

    gpu: int = 0
    dram: int = 0
    remote: int = 0
    disk: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.gpu <= self.dram <= self.remote or self.disk > self.remote:
            raise ValueError(f"coverage must be cumulative: {self}")

    @property
    def node_disk(self) -> int:
        """Leading tokens readable from this node (GPU, DRAM or disk)."""
        return max(self.dram, self.disk)


@dataclass(frozen=True)
class Load:
    pending_prefill_tokens: float = 0.0  # prompt tokens admitted but not yet prefilled
    running: int = 0  # requests in flight (prefilling or decoding)
    waiting: int = 0  # queued in the engine (scraped)
    kv_usage: float = 0.0  # GPU KV cache fill, 0..1 (scraped)


@dataclass(frozen=True)
class Candidate:
    name: str
    load: Load = field(default_factory=Load)
    coverage: Coverage = field(default_factory=Coverage)


@dataclass(frozen=True)
class RouteRequest:
    tokens: int  # prompt length
    session: str | None = None
    # What exact ties spread by: the session, else something of the prompt's start (the
    # router: its first tokens; the simulator: its first block). None: ties go by name.
    spread_key: str | None = None

    @property
    def tie_key(self) -> str | None:
        return self.session if self.session is not None else self.spread_key


@dataclass(frozen=True)
class Decision:
    index: int  # into the candidates
    reason: str  # "score", "affinity", "sticky", "overloaded", "round-robin", ...
    scores: tuple[float, ...] = ()  # per candidate, lower is better (policy's own unit)


class TierCosts(KappaTable):
    """kappa per tier and length (``kvtier.core.costs``), applied to a candidate's coverage."""

    _last: tuple[int, float, float, float] = (-1, 1.0, 1.0, 1.0)

    def uncached(self, coverage: Coverage, tokens: int) -> float:
        """Recompute-equivalent tokens the instance must spend on this prompt: each tier's
        share of the prefix at (1 - kappa) of a recompute (disk at 0 saving unless measured:
        ``kvtier bench tier-latency --kappa-out``)."""
        gpu = min(coverage.gpu, tokens)
        dram = min(coverage.dram, tokens)
        disk = min(coverage.node_disk, tokens)
        remote = min(coverage.remote, tokens)
        costs = self._last  # a decision prices every candidate at one length: kappa once
        if costs[0] != tokens:
            costs = self._last = (
                tokens,
                1 - self.kappa("dram", tokens),
                1 - self.kappa("disk", tokens),
                1 - self.kappa("remote", tokens),
            )
        return (
            (dram - gpu) * costs[1]
            + (disk - dram) * costs[2]
            + (remote - disk) * costs[3]
            + (tokens - remote)
        )


@dataclass(frozen=True)
class OffloadGate:
    """Selective prefill offload's cost model (``router/offload.py``; the simulator's
    ``ClusterSpec.offload``), in recompute-equivalent tokens (``TierCosts``):

    - here:    home's pending prefill + what home must compute of the prompt;
    - through a helper: max(helper's pending prefill + what the helper must compute, home's
      pending prefill: the request still waits its turn there) + loading, at home, what home
      lacks from the tier the helper's chunks land in (DRAM on its node, remote otherwise).

    Offload when the prompt is heavy (home computes at least ``min_tokens``) and the helper is
    cheaper by ``margin``."""

    costs: TierCosts
    min_tokens: int = 8192
    margin: float = 0.2

    def here(self, home: Coverage, home_pending: float, tokens: int) -> float | None:
        """Home's cost, or None when the prompt is not heavy enough to consider moving."""
        if tokens < self.min_tokens:
            return None
        computes = self.costs.uncached(home, tokens)
        if computes < self.min_tokens:
            return None  # home holds most of it: nothing heavy to move
        return home_pending + computes

    def through(
        self, home: Coverage, home_pending: float, helper: Coverage, helper_pending: float,
        same_node: bool, tokens: int,
    ) -> float:  # fmt: skip
        computed = helper_pending + self.costs.uncached(helper, tokens)
        tier = "dram" if same_node else "remote"
        lacking = max(0, tokens - home.gpu)
        return max(computed, home_pending) + lacking * (1 - self.costs.kappa(tier, tokens))

    def worth(self, here: float, through: float) -> bool:
        return through <= here * (1 - self.margin)


class Policy(abc.ABC):
    name: str

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of ``candidates`` (non-empty, all routable) for ``request``."""


def _argmin(keys: Sequence[tuple[float | int | str, ...]]) -> int:
    return min(range(len(keys)), key=keys.__getitem__)


def _pick(
    request: RouteRequest, candidates: Sequence[Candidate], keys: Sequence[tuple[float, ...]]
) -> int:
    """The argmin of ``keys`` + ``_spread``: the rendezvous hash is computed only among exact
    ties (it is the last tie-breaker, and hashing every candidate is most of a decision)."""
    best = min(keys)
    tied = [i for i, k in enumerate(keys) if k == best]
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda i: _spread(request, candidates[i]))


def _load_key(c: Candidate) -> tuple[float, int]:
    return c.load.pending_prefill_tokens, c.load.running


def _spread(request: RouteRequest, c: Candidate) -> tuple[int, str]:
    """The last tie-breaker: rendezvous hashing of the request's tie key with each name (the
    same order in every router replica, uniform over instances), then the name."""
    key = request.tie_key
    if key is None:
        return 0, c.name
    digest = hashlib.blake2b(f"{key}\0{c.name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little"), c.name


def _overloaded(c: Candidate, candidates: Sequence[Candidate], factor: float) -> bool:
    """Load (pending prefill tokens, else running requests) above ``factor`` x the average."""
    pending = [x.load.pending_prefill_tokens for x in candidates]
    if sum(pending) > 0:
        return c.load.pending_prefill_tokens > factor * (sum(pending) / len(pending))
    running = [x.load.running for x in candidates]
    return sum(running) > 0 and c.load.running > factor * (sum(running) / len(running))


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        i = self._next % len(candidates)
        self._next += 1
        return Decision(i, "round-robin")


class LeastLoad(Policy):
    name = "least-load"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        keys = [_load_key(c) for c in candidates]
        return Decision(
            _pick(request, candidates, keys), "least-load", tuple(float(k[0]) for k in keys)
        )


class Sticky(Policy):
    """Session-sticky with the reference's overload override. Remembers ``max_sessions``
    sessions (least recently used forgotten first)."""

    name = "sticky"

    def __init__(self, overload_factor: float = 2.0, max_sessions: int = 1 << 20) -> None:
        self.overload_factor = overload_factor
        self.max_sessions = max_sessions
        self._home: OrderedDict[str, str] = OrderedDict()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        least = LeastLoad().choose(request, candidates)
        if request.session is None:
            return Decision(least.index, "no-session", least.scores)
        home = self._home.get(request.session)
        names = [c.name for c in candidates]
        reason = "new-session"
        if home is not None and home in names:
            i = names.index(home)
            if not _overloaded(candidates[i], candidates, self.overload_factor):
                self._home.move_to_end(request.session)
                return Decision(i, "sticky", least.scores)
            reason = "overloaded"
        elif home is not None:
            reason = "home-unavailable"
        self._home[request.session] = names[least.index]
        self._home.move_to_end(request.session)
        while len(self._home) > self.max_sessions:
            self._home.popitem(last=False)
        return Decision(least.index, reason, least.scores)


class CacheAware(Policy):
    name = "cache-aware"

    def __init__(self, dram_credit: float = 0.5) -> None:
        self.dram_credit = dram_credit

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        def cached(c: Candidate) -> float:
            return c.coverage.gpu + self.dram_credit * (c.coverage.dram - c.coverage.gpu)

        keys = [(-cached(c), *_load_key(c)) for c in candidates]
        return Decision(
            _pick(request, candidates, keys), "longest-prefix", tuple(float(k[0]) for k in keys)
        )


class LMetric(Policy):
    name = "lmetric"

    def __init__(self, dram_credit: float = 0.5) -> None:
        self.dram_credit = dram_credit

    def uncached(self, c: Candidate, tokens: int) -> float:
        gpu, dram = min(c.coverage.gpu, tokens), min(c.coverage.dram, tokens)
        return tokens - gpu - self.dram_credit * (dram - gpu)

    def score(self, c: Candidate, tokens: int) -> float:
        return (c.load.pending_prefill_tokens + self.uncached(c, tokens)) * (c.load.running + 1)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = [self.score(c, request.tokens) for c in candidates]
        keys = [
            (s, self.uncached(c, request.tokens), *_load_key(c))
            for s, c in zip(scores, candidates, strict=True)
        ]
        return Decision(_pick(request, candidates, keys), "score", tuple(scores))


class Hybrid(LMetric):
    """LMetric plus an affinity gate: the instance whose GPU holds more than ``affinity``
    of the prompt keeps it unless overloaded."""

    name = "hybrid"

    def __init__(
        self, dram_credit: float = 0.5, affinity: float = 0.5, overload_factor: float = 2.0
    ) -> None:
        super().__init__(dram_credit)
        self.affinity = affinity
        self.overload_factor = overload_factor

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        base = super().choose(request, candidates)
        holder = _argmin([(-c.coverage.gpu, c.name) for c in candidates])
        held = candidates[holder].coverage.gpu
        if (
            held > self.affinity * request.tokens
            and holder != base.index
            and not _overloaded(candidates[holder], candidates, self.overload_factor)
        ):
            return Decision(holder, "affinity", base.scores)
        return base


class Kvtier(Policy):
    """Tier-priced LMetric. The affinity gate keeps the GPU holder unless another instance's
    estimated TTFT, refetch cost included, is lower by more than ``gate_margin``: the score
    already prices leaving (a fetch at 1 - kappa), the margin stops ping-pong on near ties."""

    name = "kvtier"

    def __init__(
        self,
        costs: TierCosts | None = None,
        affinity: float = 0.5,
        gate_margin: float = 0.1,
    ) -> None:
        self.costs = costs or TierCosts()
        self.affinity = affinity
        self.gate_margin = gate_margin

    def score(self, c: Candidate, tokens: int) -> float:
        uncached = self.costs.uncached(c.coverage, tokens)
        return (c.load.pending_prefill_tokens + uncached) * (c.load.running + 1)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        tokens = request.tokens
        scores = [self.score(c, tokens) for c in candidates]
        keys = [
            (s, -c.coverage.gpu, *_load_key(c)) for s, c in zip(scores, candidates, strict=True)
        ]
        best = _pick(request, candidates, keys)
        holder = _argmin([(-c.coverage.gpu, c.name) for c in candidates])
        if (
            holder != best
            and candidates[holder].coverage.gpu > self.affinity * tokens
            and scores[best] >= (1 - self.gate_margin) * scores[holder]
        ):
            return Decision(holder, "affinity", tuple(scores))
        return Decision(best, "score", tuple(scores))


POLICIES = ("round-robin", "least-load", "sticky", "cache-aware", "lmetric", "hybrid", "kvtier")


def make_policy(name: str, dram_credit: float = 0.5, costs: TierCosts | None = None) -> Policy:
    """A fresh policy by name (``dram_credit``: what a DRAM-held token counts for in the
    credit-based policies; ``costs``: kappa for ``kvtier``)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "sticky":
        return Sticky()
    if name == "cache-aware":
        return CacheAware(dram_credit)
    if name == "lmetric":
        return LMetric(dram_credit)
    if name == "hybrid":
        return Hybrid(dram_credit)
    if name == "kvtier":
        return Kvtier(costs)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
