"""``kvtier trace simulate``: replay a trace through a model of kvtier's tiers.

The model: ``instances`` vLLM instances, each with a GPU prefix cache of ``gpu_blocks``
(vLLM's own, LRU); ``instances_per_node`` of them share a node's DRAM pool of ``dram_blocks``
(kvtier's store, ``dram_policy``); other nodes' pools form the remote tier. A request, routed to
an instance by the routing policy, takes

1. its GPU prefix hit (looked up and touched, vLLM style),
2. then the run of following blocks in its node's pool (``StoreCore.lookup``),
3. then the run of following blocks that some other node's pool holds (remote),
4. and computes the rest (miss).

Afterwards the GPU cache stores every block, and the node pool stores every block beyond the
GPU hit (computed chunks are saved and remote chunks land in local DRAM), through ``BlockCache``
(the store's semantics and policy classes, so simulator and store agree by construction).

Routing uses the router's own policies (``kvtier.router.policies``, adapted in ``routing.py``):
the simulator is where a policy is tuned before the router serves with it unchanged.

A coarse time model feeds load-aware routing and a modelled TTFT: each instance prefills one
request at a time at ``prefill_tokens_per_s`` (plus per-token load costs for DRAM and remote
hits), then decodes at ``decode_ms_per_token``. Caches change at arrival; remote reads do not
touch the holder's policy. The model compares routing and capacity choices; it does not predict
latency.

Every spec of a sweep is fed in the same single pass over the trace. Per request the cost
grows with the prompt's blocks and only through numpy with the instance count (``Holders``,
``fastroute.py``), so 1,000 instances run in minutes; ``Replication`` (replicate.py) scales a
trace's load up to such a fleet.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.router.policies import Coverage, OffloadGate, Policy, TierCosts, make_policy
from kvtier.traces.formats import (
    DEFAULT_BLOCK_TOKENS,
    TraceFormat,
    TraceReader,
    TraceRequest,
)
from kvtier.traces.holders import Holders, next_false
from kvtier.traces.replicate import Replication
from kvtier.traces.routing import SimRouter
from kvtier.traces.sessions import SessionTracker
from kvtier.traces.simcache import BlockCache

TIERS = ("gpu", "local_dram", "remote", "miss")


@dataclass(frozen=True)
class ClusterSpec:
    instances: int = 4
    instances_per_node: int = 2
    gpu_blocks: int = 2048  # per instance
    dram_blocks: int = 8192  # per node pool; 0 = no DRAM tier
    gpu_policy: str = "lru"
    dram_policy: str = "s3fifo"
    remote: bool = True
    routing: str = "lmetric"  # any name in kvtier.router.policies.POLICIES
    dram_credit: float = 0.5  # routing: a DRAM-held block counts this much of a GPU-held one
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefill_tokens_per_s: float = 10_000.0
    decode_ms_per_token: float = 20.0
    dram_load_us_per_token: float = 2.5  # ~ reference: CPU hit minus GPU hit at 64k tokens
    remote_load_us_per_token: float = 13.0  # ~ reference: RDMA hit minus GPU hit at 64k tokens
    # selective prefill offload (router.offload): the router's gate, among the
    # ``offload_helpers`` least loaded instances, at most ``offload_max_concurrent`` at once
    offload: bool = False
    offload_min_tokens: int = 8192
    offload_margin: float = 0.2
    offload_max_concurrent: int = 2
    offload_helpers: int = 16

    def __post_init__(self) -> None:
        if self.instances < 1 or self.instances_per_node < 1:
            raise ValueError("instances and instances_per_node must be >= 1")
        if self.gpu_blocks < 0 or self.dram_blocks < 0:
            raise ValueError("capacities must be >= 0")

    @property
    def nodes(self) -> int:
        return -(-self.instances // self.instances_per_node)


@dataclass
class _Instance:
    gpu: BlockCache
    node: int
    requests: int = 0
    miss_tokens: int = 0


class ClusterSim:
    """One cluster model. ``step`` is called per request in arrival order; not thread-safe.

    Per request the work grows with the prompt's blocks, not with instances x blocks: which
    instances' GPUs and which nodes' pools hold each block is kept as bitmaps (``Holders``,
    fed by what each ``BlockCache.store`` inserts and evicts), every instance's runs come from
    one walk over the prompt (``tier_run_arrays``), and load lives in numpy arrays. Routing
    reads both through ``SimRouter``'s array path (fastroute.py); the per-instance lists
    (``tier_runs``, ``loads``) remain for the general path and for tests.
    """

    def __init__(self, spec: ClusterSpec, policy: Policy | None = None) -> None:
        self.spec = spec
        self.router = SimRouter(
            policy or make_policy(spec.routing, spec.dram_credit),
            spec.instances,
            spec.block_tokens,
        )
        self.instances = [
            _Instance(BlockCache(spec.gpu_blocks, spec.gpu_policy), i // spec.instances_per_node)
            for i in range(spec.instances)
        ]
        self.pools = [BlockCache(spec.dram_blocks, spec.dram_policy) for _ in range(spec.nodes)]
        self._track_remote = spec.remote and spec.nodes > 1 and spec.dram_blocks > 0
        self._gpu_holders = Holders(spec.instances)  # block -> instances whose GPU holds it
        self._pool_holders = Holders(spec.nodes)  # block -> nodes whose pool holds it
        self._node_of = np.arange(spec.instances, dtype=np.int64) // spec.instances_per_node
        # Load: prefill queue end per instance; requests not finished per instance, kept
        # current by popping (finish time, instance) events up to each arrival.
        self._prefill_free_at = np.zeros(spec.instances)
        self._running = np.zeros(spec.instances, dtype=np.int64)
        self._finishing: list[tuple[float, int]] = []
        self.blocks = dict.fromkeys(TIERS, 0)
        self.tokens = dict.fromkeys(TIERS, 0)
        self.ttft_s: list[float] = []
        self.requests = 0
        self.decisions: Counter[str] = Counter()  # routing decisions by reason
        self.gate = (
            OffloadGate(TierCosts(), spec.offload_min_tokens, spec.offload_margin)
            if spec.offload
            else None
        )
        self._offloads_until: list[float] = []  # helpers' prefill ends, in flight (a heap)
        self.offloads = 0

    # -- ClusterView (routing.py) --------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.instances)

    def tier_run_arrays(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per instance (int64 arrays): blocks of ``ids`` it would read from its GPU, then
        its node's pool, then other nodes' pools (leading runs, in that order), without
        touching any cache. The same numbers as asking every cache in turn (``match``)."""
        gpu, longest = self._gpu_holders.leading_runs(ids)
        pools = self._pool_holders
        bits = pools.bitmaps(ids) if len(pools) else [0]
        # Runs from a start at or before the first block no pool holds end there; later rows
        # matter only to an instance whose GPU run goes past it (then all rows are needed).
        cold = bits.index(0) if 0 in bits else len(bits)
        if (cold == 0 and longest == 0) or not len(pools):
            zeros = np.zeros_like(gpu)  # no pool holds a block any instance would start at
            return gpu, zeros, zeros
        held = pools.unpack(bits if longest > cold else bits[: cold + 1])  # (blocks, nodes)
        node = self._node_of
        dram = next_false(held)[gpu, node] - gpu
        if not self._track_remote:
            return gpu, dram, np.zeros_like(gpu)
        # Another node holds block t when more pools hold it than this node's own.
        elsewhere = held.sum(axis=1, dtype=np.int64)[:, None] - held > 0
        start = gpu + dram
        return gpu, dram, next_false(elsewhere)[start, node] - start

    def tier_runs(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``tier_run_arrays`` as one (gpu, dram, remote) tuple per instance."""
        gpu, dram, remote = self.tier_run_arrays(ids)
        return list(zip(gpu.tolist(), dram.tolist(), remote.tolist(), strict=True))

    def load_arrays(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per instance at ``now``: pending prefill tokens (float64), running requests
        (int64). Arrivals come in time order, so finished requests are dropped for good."""
        heap, running = self._finishing, self._running
        while heap and heap[0][0] <= now:
            running[heapq.heappop(heap)[1]] -= 1
        backlog = self._prefill_free_at - now
        pending = np.where(backlog > 0, backlog * self.spec.prefill_tokens_per_s, 0.0)
        return pending, running

    def loads(self, now: float) -> list[tuple[float, int]]:
        pending, running = self.load_arrays(now)
        return list(zip(pending.tolist(), running.tolist(), strict=True))

    def pending_prefill_tokens(self, instance: int, now: float) -> float:
        backlog = float(self._prefill_free_at[instance]) - now
        return backlog * self.spec.prefill_tokens_per_s if backlog > 0 else 0.0

    def running(self, instance: int, now: float) -> int:
        return int(self.load_arrays(now)[1][instance])

    def _remote_run(self, node: int, ids: Sequence[int], start: int) -> int:
        """Leading blocks of ``ids[start:]`` that some other node's pool holds."""
        if not self._track_remote:
            return 0
        holders = self._pool_holders
        others = ~(1 << node)
        r = 0
        for key in ids[start:]:
            if not holders.get(key) & others:
                break
            r += 1
        return r

    # -- simulation ----------------------------------------------------------------------

    def step(
        self, req: TraceRequest, session: int | None = None
    ) -> tuple[int, tuple[int, int, int, int]]:
        """Serve one request of ``session`` (None: unknown); returns (instance, blocks per
        tier in TIERS order)."""
        spec = self.spec
        ids = req.hash_ids
        now = req.timestamp / 1000.0
        decision = self.router.choose(self, ids, req.input_length, session, now)
        self.decisions[decision.reason] += 1
        i = decision.index
        helper = self._helper(i, ids, req.input_length, now) if self.gate is not None else None
        if helper is not None:
            return self._offloaded(req, i, helper, now)
        counts, done = self._compute(req, i, now)
        finish = done + req.output_length * spec.decode_ms_per_token / 1e3
        heapq.heappush(self._finishing, (finish, i))
        self._running[i] += 1
        self.instances[i].requests += 1
        self.ttft_s.append(done - now)
        self.requests += 1
        return i, counts

    def _compute(
        self, req: TraceRequest, i: int, now: float
    ) -> tuple[tuple[int, int, int, int], float]:
        """Instance ``i`` prefills ``req``: its GPU run, then its node's pool, then other
        nodes' pools, computing the rest; its caches store the prompt, the tiers are counted,
        and its prefill queue takes the work. Returns (blocks per tier, when the prefill is
        done)."""
        spec, ids = self.spec, req.hash_ids
        inst = self.instances[i]
        pool = self.pools[inst.node]
        n = len(ids)
        g = inst.gpu.lookup(ids)
        d = pool.lookup(ids, g)
        r = self._remote_run(inst.node, ids, g + d)
        counts = (g, d, r, n - g - d - r)
        self._gpu_holders.update(i, *inst.gpu.store(ids))
        self._pool_holders.update(inst.node, *pool.store(ids, g))

        bt = spec.block_tokens
        remaining = req.input_length
        for tier, blocks in zip(TIERS, counts, strict=True):
            self.blocks[tier] += blocks
            tokens = min(blocks * bt, remaining)
            remaining -= tokens
            self.tokens[tier] += tokens
        miss_tokens = max(req.input_length - min((g + d + r) * bt, req.input_length), 0)
        load_s = (
            min(d * bt, req.input_length) * spec.dram_load_us_per_token
            + min(r * bt, req.input_length) * spec.remote_load_us_per_token
        ) / 1e6
        start = max(now, float(self._prefill_free_at[i]))
        done = start + load_s + miss_tokens / spec.prefill_tokens_per_s
        self._prefill_free_at[i] = done
        inst.miss_tokens += miss_tokens
        return counts, done

    def _helper(self, home: int, ids: Sequence[int], tokens: int, now: float) -> int | None:
        """The instance to prefill on instead of ``home`` (the router's ``OffloadGate``), or
        None. Helpers are looked for among the ``offload_helpers`` least loaded instances (the
        router weighs every instance; a helper's pending prefill dominates its cost)."""
        gate, spec = self.gate, self.spec
        assert gate is not None
        running = self._offloads_until
        while running and running[0] <= now:
            heapq.heappop(running)
        if len(running) >= spec.offload_max_concurrent or spec.instances < 2:
            return None
        bt = spec.block_tokens
        gpu, dram, remote = self.tier_run_arrays(ids)
        pending, _ = self.load_arrays(now)

        def coverage(j: int) -> Coverage:
            g = min(int(gpu[j]) * bt, tokens)
            d = min(g + int(dram[j]) * bt, tokens)
            return Coverage(g, d, min(d + int(remote[j]) * bt, tokens))

        home_cov = coverage(home)
        here = gate.here(home_cov, float(pending[home]), tokens)
        if here is None:
            return None
        k = min(spec.offload_helpers + 1, spec.instances)
        nearest = np.argpartition(pending, k - 1)[:k] if k < spec.instances else range(k)
        best, best_cost = None, float("inf")
        for j in (int(x) for x in nearest):
            if j == home:
                continue
            same = self.instances[j].node == self.instances[home].node
            cost = gate.through(
                home_cov, float(pending[home]), coverage(j), float(pending[j]), same, tokens
            )
            if cost < best_cost:
                best, best_cost = j, cost
        if best is None or not gate.worth(here, best_cost):
            return None
        return best

    def _offloaded(
        self, req: TraceRequest, home: int, helper: int, now: float
    ) -> tuple[int, tuple[int, int, int, int]]:
        """The helper prefills the prompt (one output token) and its chunks land in its node's
        pool; then home loads from there what its GPU lacks (DRAM on the same node, remote
        otherwise) and decodes. Tiers are counted where the prompt was computed."""
        spec, bt, ids = self.spec, self.spec.block_tokens, req.hash_ids
        h, inst = self.instances[helper], self.instances[home]
        counts, helper_done = self._compute(req, helper, now)  # one output token: no decode
        heapq.heappush(self._finishing, (helper_done, helper))
        self._running[helper] += 1
        heapq.heappush(self._offloads_until, helper_done)
        # home: its own GPU run, the rest from the helper's node pool
        home_g = inst.gpu.lookup(ids)
        per_token = (
            spec.dram_load_us_per_token if h.node == inst.node else spec.remote_load_us_per_token
        )
        moved = max(req.input_length - min(home_g * bt, req.input_length), 0)
        self._gpu_holders.update(home, *inst.gpu.store(ids))
        self._pool_holders.update(inst.node, *self.pools[inst.node].store(ids, home_g))
        start = max(helper_done, float(self._prefill_free_at[home]))
        done = start + moved * per_token / 1e6
        self._prefill_free_at[home] = done
        finish = done + req.output_length * spec.decode_ms_per_token / 1e3
        heapq.heappush(self._finishing, (finish, home))
        self._running[home] += 1
        inst.requests += 1
        self.ttft_s.append(done - now)
        self.requests += 1
        self.offloads += 1
        self.decisions["offloaded"] += 1
        return home, counts

    def report(self) -> dict[str, Any]:
        total_blocks = sum(self.blocks.values())
        total_tokens = sum(self.tokens.values())
        per_req = np.array([inst.requests for inst in self.instances], dtype=float)
        per_miss = np.array([inst.miss_tokens for inst in self.instances], dtype=float)
        ttft = np.array(self.ttft_s) if self.ttft_s else np.zeros(1)
        return {
            "spec": asdict(self.spec),
            "requests": self.requests,
            "hit_ratio_blocks": {t: _ratio(self.blocks[t], total_blocks) for t in TIERS},
            "hit_ratio_tokens": {t: _ratio(self.tokens[t], total_tokens) for t in TIERS},
            "total_hit_ratio": _ratio(total_blocks - self.blocks["miss"], total_blocks),
            "load": {
                "requests_max_over_mean": _ratio(per_req.max(), per_req.mean()),
                "miss_tokens_max_over_mean": _ratio(per_miss.max(), per_miss.mean()),
                "requests_per_instance": [int(x) for x in per_req],
            },
            "routing_decisions": dict(self.decisions.most_common()),
            "offloads": self.offloads,
            "modelled_ttft_s": {f"p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)},
            "evictions": {
                "gpu": sum(inst.gpu.evictions for inst in self.instances),
                "dram": sum(pool.evictions for pool in self.pools),
            },
        }


def simulate(
    requests: Iterable[TraceRequest],
    specs: Sequence[ClusterSpec],
    *,
    derive_sessions: bool,
    with_sessions: bool | None = None,
) -> list[dict[str, Any]]:
    """Feed every spec the same requests in one pass; returns one report per spec.

    Sessions are tracked, and handed to every spec (its policy's tie-break then spreads by
    session), when ``with_sessions``; by default when some spec routes ``sticky``."""
    if not specs:
        return []
    sims = [ClusterSim(spec) for spec in specs]
    block_tokens = specs[0].block_tokens
    if with_sessions is None:
        with_sessions = any(spec.routing == "sticky" for spec in specs)
    tracker = SessionTracker.standalone(block_tokens, derive=derive_sessions)
    for req in requests:
        session = None
        if with_sessions:
            session = tracker.observe(req).session
        for sim in sims:
            sim.step(req, session)
    return [sim.report() for sim in sims]


def _simulate_file(
    path: str,
    fmt: str,
    block_tokens: int,
    specs: list[ClusterSpec],
    replication: Replication,
    with_sessions: bool | None = None,
) -> list[dict[str, Any]]:
    reader = TraceReader(path, fmt, block_tokens)
    return simulate(
        replication.apply(reader),
        specs,
        derive_sessions=reader.format is TraceFormat.MOONCAKE,
        with_sessions=with_sessions,
    )


def simulate_file(
    path: Path | str,
    specs: Sequence[ClusterSpec],
    fmt: TraceFormat | str = TraceFormat.AUTO,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    jobs: int = 1,
    replication: Replication | None = None,
) -> list[dict[str, Any]]:
    """``simulate`` over a file (``replication``: K copies, time scale; none by default), the
    specs split over ``jobs`` processes (each reads the file; the specs are independent).
    Reports come back in the order of ``specs``."""
    replication = replication or Replication()
    jobs = max(1, min(jobs, len(specs)))
    if jobs == 1:
        return _simulate_file(str(path), str(fmt), block_tokens, list(specs), replication)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    groups = [list(specs[i::jobs]) for i in range(jobs)]
    # Sessions as one process over all specs would have them, so --jobs changes no figure.
    sessions = any(spec.routing == "sticky" for spec in specs)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(_simulate_file, str(path), str(fmt), block_tokens, g, replication, sessions)
            for g in groups
        ]
        parts = [f.result() for f in futures]
    out: list[dict[str, Any]] = [{}] * len(specs)
    for i, part in enumerate(parts):
        for j, report in enumerate(part):
            out[i + j * jobs] = report
    return out


def sweep_specs(
    base: ClusterSpec,
    gpu_blocks: Sequence[int] = (),
    dram_blocks: Sequence[int] = (),
    routings: Sequence[str] = (),
    dram_policies: Sequence[str] = (),
    offloads: Sequence[bool] = (),
) -> list[ClusterSpec]:
    """The cross product of the given axes around ``base`` (an empty axis keeps base's value)."""
    out = []
    for offload in offloads or [base.offload]:
        spec = replace(base, offload=offload)
        out += _sweep(spec, gpu_blocks, dram_blocks, routings, dram_policies)
    return out


def _sweep(
    base: ClusterSpec,
    gpu_blocks: Sequence[int],
    dram_blocks: Sequence[int],
    routings: Sequence[str],
    dram_policies: Sequence[str],
) -> list[ClusterSpec]:
    out = []
    for policy in dram_policies or [base.dram_policy]:
        for routing in routings or [base.routing]:
            for dram in dram_blocks or [base.dram_blocks]:
                for gpu in gpu_blocks or [base.gpu_blocks]:
                    out.append(
                        replace(
                            base,
                            gpu_blocks=gpu,
                            dram_blocks=dram,
                            routing=routing,
                            dram_policy=policy,
                        )
                    )
    return out


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b else 0.0
