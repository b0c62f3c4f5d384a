"""Fleet scale: the simulator's bitmap runs and numpy routing decide exactly as the per-instance
path did (a reference copy of it lives here), and trace replication adds load as distinct users.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import Counter
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.router.policies import (
    POLICIES,
    Candidate,
    LeastLoad,
    Load,
    RoundRobin,
    RouteRequest,
    Sticky,
    _spread,
    make_policy,
)
from kvtier.traces.fastroute import rendezvous
from kvtier.traces.formats import TraceRequest, read_trace
from kvtier.traces.holders import Holders, next_false
from kvtier.traces.replicate import Replication
from kvtier.traces.routing import SimRouter, coverage_from_blocks
from kvtier.traces.sessions import SessionTracker
from kvtier.traces.simcache import BlockCache
from kvtier.traces.simulate import TIERS, ClusterSim, ClusterSpec, simulate

from support.trace_helpers import SHARED_TRACE, shared_lines, write_trace


@pytest.fixture(scope="module")
def shared() -> list[TraceRequest]:
    """600 requests from late in the trace, where an infinite cache would hit 49 % of blocks
    (11 % over its first 600)."""
    return list(itertools.islice(read_trace(SHARED_TRACE), 3000, 3600))


# -- the reference: the simulator before fleet scale, every cache and candidate in turn --------


class _RefInstance:
    def __init__(self, gpu: BlockCache, node: int) -> None:
        self.gpu, self.node = gpu, node
        self.prefill_free_at = 0.0
        self.finishing: list[float] = []
        self.requests = self.miss_tokens = 0


class ReferenceSim:
    """``ClusterSim`` as it was: ``tier_runs`` asks every instance's cache, each instance keeps
    a heap of finish times, remote holders are counts, and the policy sees every candidate."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.policy = make_policy(spec.routing, spec.dram_credit)
        self.names = SimRouter(self.policy, spec.instances, spec.block_tokens).names
        self.instances = [
            _RefInstance(BlockCache(spec.gpu_blocks, spec.gpu_policy), i // spec.instances_per_node)
            for i in range(spec.instances)
        ]
        self.pools = [BlockCache(spec.dram_blocks, spec.dram_policy) for _ in range(spec.nodes)]
        self._track_remote = spec.remote and spec.nodes > 1 and spec.dram_blocks > 0
        self._holders: dict[Hashable, int] = {}
        self.blocks = dict.fromkeys(TIERS, 0)
        self.tokens = dict.fromkeys(TIERS, 0)
        self.ttft_s: list[float] = []
        self.requests = 0
        self.offloads = 0  # the reference has no offload (specs here leave it off)
        self.decisions: Counter[str] = Counter()

    def tier_runs(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        out = []
        node_runs: dict[tuple[int, int], tuple[int, int]] = {}
        for inst in self.instances:
            g = inst.gpu.match(ids)
            runs = node_runs.get((inst.node, g))
            if runs is None:
                pool = self.pools[inst.node]
                d = pool.match(ids, g)
                runs = node_runs[(inst.node, g)] = (d, self._remote_run(pool, ids, g + d))
            out.append((g, *runs))
        return out

    def loads(self, now: float) -> list[tuple[float, int]]:
        out = []
        for inst in self.instances:
            backlog = inst.prefill_free_at - now
            pending = backlog * self.spec.prefill_tokens_per_s if backlog > 0 else 0.0
            while inst.finishing and inst.finishing[0] <= now:
                heapq.heappop(inst.finishing)
            out.append((pending, len(inst.finishing)))
        return out

    def _remote_run(self, pool: BlockCache, ids: Sequence[int], start: int) -> int:
        if not self._track_remote:
            return 0
        r = 0
        for key in ids[start:]:
            if self._holders.get(key, 0) - (key in pool) <= 0:
                break
            r += 1
        return r

    def step(self, req: TraceRequest, session: int | None) -> tuple[int, tuple[int, ...]]:
        spec, ids, bt = self.spec, req.hash_ids, self.spec.block_tokens
        now = req.timestamp / 1000.0
        loads = self.loads(now)
        if isinstance(self.policy, (RoundRobin, LeastLoad, Sticky)):
            cands = [Candidate(n, Load(*load)) for n, load in zip(self.names, loads, strict=True)]
        else:
            cands = [
                Candidate(n, Load(*load), coverage_from_blocks(runs, req.input_length, bt))
                for n, load, runs in zip(self.names, loads, self.tier_runs(ids), strict=True)
            ]
        spread = f"{len(ids)}:{ids[-1]}" if ids else None
        request = RouteRequest(req.input_length, None if session is None else str(session), spread)
        decision = self.policy.choose(request, cands)
        self.decisions[decision.reason] += 1
        i = decision.index
        inst = self.instances[i]
        pool = self.pools[inst.node]
        g = inst.gpu.lookup(ids)
        d = pool.lookup(ids, g)
        r = self._remote_run(pool, ids, g + d)
        counts = (g, d, r, len(ids) - g - d - r)
        inst.gpu.store(ids)
        inserted, evicted = pool.store(ids, g)
        if self._track_remote:
            for block in inserted:
                self._holders[block] = self._holders.get(block, 0) + 1
            for block in evicted:
                self._holders[block] -= 1
                if not self._holders[block]:
                    del self._holders[block]
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
        start = max(now, inst.prefill_free_at)
        done = start + load_s + miss_tokens / spec.prefill_tokens_per_s
        inst.prefill_free_at = done
        heapq.heappush(inst.finishing, done + req.output_length * spec.decode_ms_per_token / 1e3)
        inst.requests += 1
        inst.miss_tokens += miss_tokens
        self.ttft_s.append(done - now)
        self.requests += 1
        return i, counts

    def report(self) -> dict[str, Any]:
        return ClusterSim.report(self)  # type: ignore[arg-type]  # the same fields


# -- equivalence ---------------------------------------------------------------------------------

# (instances, per node, copies of the sample, requests of the shared trace, GPU / DRAM blocks):
# small caches so that GPUs and pools evict; copies raise the load to keep 16 and 64 busy.
FLEETS = [(4, 2, 1, 600, 800, 3000), (16, 4, 2, 400, 300, 1200), (64, 8, 4, 250, 200, 1000)]


@pytest.mark.parametrize("fleet", FLEETS, ids=lambda f: f"{f[0]}inst")
def test_fleet_path_decides_exactly_as_the_per_instance_path(
    shared: list[TraceRequest], fleet: tuple[int, int, int, int, int, int]
) -> None:
    """Every policy, on a replicated trace sample: the same instance and tier counts for every
    request, and identical reports. Sticky, least-load and kvtier see derived sessions (their
    ties spread by session); the others see none (ties spread by the prompt)."""
    instances, per_node, copies, n, gpu, dram = fleet
    trace = list(Replication(copies=copies, spread_ms=300).apply(shared[:n]))
    tracker = SessionTracker.standalone(512, derive=True)
    sessions = [tracker.observe(r).session for r in trace]
    for routing in POLICIES:
        spec = ClusterSpec(
            instances=instances,
            instances_per_node=per_node,
            gpu_blocks=gpu,
            dram_blocks=dram,
            routing=routing,
        )
        fast, ref = ClusterSim(spec), ReferenceSim(spec)
        with_sessions = routing in ("sticky", "least-load", "kvtier")
        for k, r in enumerate(trace):
            session = sessions[k] if with_sessions else None
            assert fast.step(r, session) == ref.step(r, session), f"{routing}, request {k}"
        assert fast.report() == ref.report(), routing
        assert len(fast.decisions) >= 1


def test_tier_run_arrays_match_every_cache_asked_in_turn(shared: list[TraceRequest]) -> None:
    """The bitmaps against the caches themselves, for seen, partly seen, unseen and empty
    prompts, after GPUs and pools have evicted."""
    spec = ClusterSpec(instances=12, instances_per_node=3, gpu_blocks=200, dram_blocks=600)
    sim = ClusterSim(spec)
    for r in shared[:300]:
        sim.step(r, None)
    ref = ReferenceSim(spec)  # its tier_runs, over the simulator's own caches
    for ref_inst, inst in zip(ref.instances, sim.instances, strict=True):
        ref_inst.gpu = inst.gpu
    ref.pools = sim.pools
    for key in {h for r in shared for h in r.hash_ids}:
        ref._holders[key] = sum(key in pool for pool in sim.pools)
    for r in shared[250:450]:
        for ids in (r.hash_ids, r.hash_ids[len(r.hash_ids) // 2 :], [10**9, *r.hash_ids], []):
            assert sim.tier_runs(ids) == ref.tier_runs(ids)


def test_simulate_sweep_matches_reference_with_sticky_sessions(
    shared: list[TraceRequest],
) -> None:
    """Through ``simulate`` (sessions for every spec once sticky is swept)."""
    specs = [
        ClusterSpec(instances=8, instances_per_node=4, gpu_blocks=100, dram_blocks=300, routing=p)
        for p in ("sticky", "hybrid", "cache-aware")
    ]
    reports = simulate(shared[:400], specs, derive_sessions=True)
    tracker = SessionTracker.standalone(512, derive=True)
    refs = [ReferenceSim(s) for s in specs]
    for r in shared[:400]:
        session = tracker.observe(r).session
        for ref in refs:
            ref.step(r, session)
    assert reports == [ref.report() for ref in refs]


# -- the pieces ------------------------------------------------------------------------------


def test_holders_track_every_cache_and_give_their_leading_runs() -> None:
    rng = random.Random(3)
    caches = [BlockCache(rng.choice([0, 5, 20]), rng.choice(["lru", "s3fifo"])) for _ in range(70)]
    holders = Holders(len(caches))
    for _ in range(400):
        m = rng.randrange(len(caches))
        start = rng.randrange(3)
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 25))]
        holders.update(m, *caches[m].store(keys, start))
        probe = list(dict.fromkeys(rng.randrange(40) for _ in range(8)))
        assert holders.leading_runs(probe)[0].tolist() == [c.match(probe) for c in caches]
        held = holders.matrix(probe)
        assert held.shape == (len(probe), len(caches))
        assert all(held[j, k] == (key in caches[k]) for j, key in enumerate(probe) for k in (0, m))
    assert holders.leading_runs([])[0].tolist() == [0] * len(caches)


def test_next_false_gives_runs_from_every_start() -> None:
    held = np.array([[1, 0], [1, 1], [0, 1], [1, 1]], dtype=bool)
    out = next_false(held)
    assert out[:, 0].tolist() == [2, 2, 2, 4, 4]
    assert out[:, 1].tolist() == [0, 4, 4, 4, 4]
    assert next_false(np.zeros((0, 3), dtype=bool)).tolist() == [[0, 0, 0]]


def test_rendezvous_is_the_policies_tie_break() -> None:
    names = SimRouter(make_policy("lmetric"), 300, 512).names
    encoded = [n.encode() for n in names]
    rng = random.Random(5)
    for key in [None, "7", "31:123456", "session-é", *(str(rng.random()) for _ in range(30))]:
        request = RouteRequest(100, None, key)
        idx = sorted(rng.sample(range(len(names)), rng.randrange(1, 60)))
        want = min(idx, key=lambda i: _spread(request, Candidate(names[i])))
        assert rendezvous(request.tie_key, encoded, idx) == want


def _r(ts: float, ids: list[int], session: str | None = None) -> TraceRequest:
    return TraceRequest(
        timestamp=ts,
        input_length=512 * len(ids),
        output_length=1,
        hash_ids=ids,
        session_id=session,
        turn=None if session is None else 1,
    )


def test_replication_makes_distinct_users_merged_in_time_order() -> None:
    trace = [_r(0, [1, 2]), _r(100, [1, 2, 3]), _r(100, [7]), _r(250, [1])]
    out = list(Replication(copies=3, spread_ms=30).apply(trace))
    assert len(out) == 12
    assert [r.timestamp for r in out] == sorted(r.timestamp for r in out)
    assert [r.timestamp for r in out[:3]] == [0, 10, 20]  # copy c delayed by c * 30 / 3 ms
    copies = [[r for r in out if r.hash_ids and r.hash_ids[0] % 3 == c] for c in range(3)]
    for c, copy in enumerate(copies):  # each copy is the trace, ids mapped to id * 3 + c
        assert [r.hash_ids for r in copy] == [[h * 3 + c for h in x.hash_ids] for x in trace]
        assert [r.timestamp - 10 * c for r in copy] == [0, 100, 100, 250]
    blocks = [{h for r in copy for h in r.hash_ids} for copy in copies]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2])  # they share nothing
    # Equal times: copy order, then input order.
    assert [(r.timestamp, r.hash_ids[0]) for r in out[3:6]] == [(100, 3), (100, 21), (110, 4)]


def test_replication_identity_time_scale_and_sessions() -> None:
    trace = [_r(0, [1], "a"), _r(1000, [1, 2], "a")]
    assert list(Replication().apply(trace)) == trace
    scaled = list(Replication(time_scale=0.5).apply(trace))
    assert [r.timestamp for r in scaled] == [0, 500] and scaled[1].hash_ids == [1, 2]
    two = list(Replication(copies=2, spread_ms=0).apply(trace))
    assert [r.session_id for r in two] == ["a#0", "a#1", "a#0", "a#1"]
    with pytest.raises(ValueError, match="copies"):
        Replication(copies=0)
    with pytest.raises(ValueError, match="time_scale"):
        Replication(time_scale=0)


def test_replication_streams() -> None:
    """The first requests come out before the input ends (an endless input here)."""
    endless = (_r(t * 10.0, [t]) for t in itertools.count())
    first = list(itertools.islice(Replication(copies=4, spread_ms=20).apply(endless), 10))
    assert [r.timestamp for r in first] == [0, 5, 10, 10, 15, 15, 20, 20, 25, 25]


def test_replicated_load_per_instance_is_the_original_load(shared: list[TraceRequest]) -> None:
    """K copies on K times the instances: about the same load and TTFT per instance."""
    base = ClusterSpec(instances=4, instances_per_node=2, gpu_blocks=500, dram_blocks=2000)
    (one,) = simulate(shared[:300], [base], derive_sessions=True)
    scaled = ClusterSpec(**{**base.__dict__, "instances": 12})
    (three,) = simulate(Replication(copies=3).apply(shared[:300]), [scaled], derive_sessions=True)
    assert three["requests"] == 3 * one["requests"]
    assert abs(three["total_hit_ratio"] - one["total_hit_ratio"]) < 0.05
    assert three["modelled_ttft_s"]["p90"] < 2 * one["modelled_ttft_s"]["p90"] + 0.5


def test_cli_simulate_replicates(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", shared_lines()[:150])
    result = CliRunner().invoke(
        app,
        [
            "trace",
            "simulate",
            str(trace),
            "--instances",
            "8",
            "--routing",
            "kvtier,round-robin",
            "--replicate",
            "4",
            "--time-scale",
            "0.5",
            "--no-progress",
            "--json",
            str(tmp_path / "s.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "600 requests" in result.output and "4 copies" in result.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["replication"]["copies"] == 4
    assert [run["requests"] for run in data["runs"]] == [600, 600]
    bad = CliRunner().invoke(app, ["trace", "simulate", str(trace), "--replicate", "0"])
    assert bad.exit_code == 2
