"""The simulator's caches behave exactly like the real store, and its tiers and routing do what
the model says."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.core.keys import Namespace
from kvtier.store.api.types import AllocStatus
from kvtier.store.state.core import StoreCore
from kvtier.traces.formats import TraceRequest, read_trace
from kvtier.traces.simcache import BlockCache
from kvtier.traces.simulate import TIERS, ClusterSim, ClusterSpec, simulate, sweep_specs

from support.trace_helpers import SHARED_TRACE, req, write_trace

PAGE = 4096


@pytest.fixture(scope="module")
def shared() -> list[TraceRequest]:
    return list(read_trace(SHARED_TRACE))


def _key(h: int) -> bytes:
    return h.to_bytes(16, "big")


class RealStore:
    """A StoreCore driven as the connector drives it: lookup, then allocate + commit."""

    def __init__(self, capacity_blocks: int, policy: str) -> None:
        self.core = StoreCore(
            node_id="sim-check",
            epoch=1,
            capacity_bytes=capacity_blocks * PAGE,
            page_size=PAGE,
            eviction=policy,
        )
        ns = Namespace(
            model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_size=64, chunk_tokens=16
        )
        self.ns = self.core.register_namespace(ns, PAGE)

    def lookup(self, ids: list[int]) -> int:
        return len(self.core.lookup(self.ns, [_key(h) for h in ids]).hits)

    def store(self, ids: list[int]) -> None:
        if not ids:
            return
        result = self.core.allocate(self.ns, [_key(h) for h in ids], [PAGE] * len(ids))
        written = sum(s is AllocStatus.ALLOCATED for s in result.statuses)
        if result.lease_id:
            self.core.commit(result.lease_id, None, [1] * written)

    def held(self) -> set[int]:
        return {int.from_bytes(k, "big") for k in self.core.snapshot().chunks.get(self.ns, [])}


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("capacity", [64, 2000])
def test_block_cache_agrees_with_store_core(
    shared: list[TraceRequest], policy: str, capacity: int
) -> None:
    """Same operations, same hits after every request and same survivors at the end.

    Capacity 64 is below many requests' block count: the store's NO_SPACE path is exercised.
    """
    store, cache = RealStore(capacity, policy), BlockCache(capacity, policy)
    seen: set[int] = set()
    for i, r in enumerate(shared[:1500]):
        assert cache.lookup(r.hash_ids) == store.lookup(r.hash_ids), f"request {i}"
        cache.store(r.hash_ids)
        store.store(r.hash_ids)
        seen.update(r.hash_ids)
    assert {h for h in seen if h in cache} == store.held()
    assert cache.evictions == store.core.counters["evictions"] > 0
    store.core.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_simulated_dram_tier_is_the_store(shared: list[TraceRequest], policy: str) -> None:
    """With no GPU cache, one instance's DRAM tier hits exactly what a real store hits."""
    sim = ClusterSim(ClusterSpec(instances=1, gpu_blocks=0, dram_blocks=1500, dram_policy=policy))
    store = RealStore(1500, policy)
    for r in shared[:1500]:
        _, (gpu, dram, remote, _miss) = sim.step(r, 0)
        assert (gpu, remote) == (0, 0)
        assert dram == store.lookup(r.hash_ids)
        store.store(r.hash_ids)


def test_tiers_account_for_every_block_and_token(shared: list[TraceRequest]) -> None:
    spec = ClusterSpec(
        instances=4, instances_per_node=2, gpu_blocks=500, dram_blocks=2000, routing="round-robin"
    )
    sim = ClusterSim(spec)
    for r in shared:
        sim.step(r, 0)
    assert sum(sim.blocks.values()) == sum(len(r.hash_ids) for r in shared)
    assert sum(sim.tokens.values()) == sum(r.input_length for r in shared)
    report = sim.report()
    assert all(report["hit_ratio_blocks"][t] > 0 for t in TIERS)  # every tier is used
    assert report["total_hit_ratio"] <= 0.6396 + 1e-9  # never above an infinite cache


def test_remote_tier_and_landing_in_local_dram() -> None:
    spec = ClusterSpec(
        instances=2, instances_per_node=1, gpu_blocks=0, dram_blocks=100, routing="round-robin"
    )
    sim = ClusterSim(spec)
    a = TraceRequest(timestamp=0, input_length=1500, output_length=1, hash_ids=[1, 2, 3])
    b = TraceRequest(timestamp=1, input_length=2000, output_length=1, hash_ids=[1, 2, 3, 4])
    c = TraceRequest(timestamp=2, input_length=2000, output_length=1, hash_ids=[1, 2, 3, 5])
    d = TraceRequest(timestamp=3, input_length=2500, output_length=1, hash_ids=[1, 2, 3, 4, 6])
    assert sim.step(a, 0) == (0, (0, 0, 0, 3))  # node 0 computes and stores 1-3
    assert sim.step(b, 0) == (1, (0, 0, 3, 1))  # node 1 reads 1-3 from node 0, computes 4
    assert sim.step(c, 0) == (0, (0, 3, 0, 1))  # back on node 0: local
    assert sim.step(d, 0) == (1, (0, 4, 0, 1))  # node 1 kept what it read remotely
    no_remote = ClusterSim(ClusterSpec(**{**spec.__dict__, "remote": False}))
    no_remote.step(a, 0)
    assert no_remote.step(b, 0) == (1, (0, 0, 0, 4))


def test_gpu_tier_comes_first() -> None:
    sim = ClusterSim(ClusterSpec(instances=1, gpu_blocks=2, dram_blocks=100))
    a = TraceRequest(timestamp=0, input_length=2000, output_length=1, hash_ids=[1, 2, 3, 4])
    assert sim.step(a, 0)[1] == (0, 0, 0, 4)
    # A batch larger than the GPU cache keeps what fitted first (the store's NO_SPACE rule):
    # the prefix 1, 2 from the GPU, the rest from DRAM.
    assert sim.step(a, 0)[1] == (2, 2, 0, 0)
    b = TraceRequest(timestamp=1, input_length=1500, output_length=1, hash_ids=[5, 6, 7])
    sim.step(b, 0)  # LRU: the GPU now holds 1 and 2 (touched) minus what 5, 6 evicted
    assert sim.step(a, 0)[1] == (0, 4, 0, 0)


def _hot_prefix_trace(n: int) -> list[TraceRequest]:
    # One long shared prefix (a system prompt), a unique tail each, all at once.
    return [
        TraceRequest(
            timestamp=i,
            input_length=20 * 512,
            output_length=50,
            hash_ids=[*range(10), *range(1000 + 10 * i, 1010 + 10 * i)],
        )
        for i in range(n)
    ]


def test_cache_affinity_alone_makes_a_hot_spot_lmetric_does_not() -> None:
    trace = _hot_prefix_trace(40)
    base = ClusterSpec(instances=4, instances_per_node=4, gpu_blocks=10_000, dram_blocks=0)
    aware, lmetric, rr = simulate(
        trace,
        [
            ClusterSpec(**{**base.__dict__, "routing": r})
            for r in ("cache-aware", "lmetric", "round-robin")
        ],
        derive_sessions=True,
    )
    assert sorted(aware["load"]["requests_per_instance"]) == [0, 0, 0, 40]  # one instance
    assert max(lmetric["load"]["requests_per_instance"]) <= 15
    assert lmetric["hit_ratio_blocks"]["gpu"] > rr["hit_ratio_blocks"]["gpu"] * 0.95
    assert lmetric["modelled_ttft_s"]["p90"] < aware["modelled_ttft_s"]["p90"]


def test_sticky_routing_keeps_sessions_home(tmp_path: Path) -> None:
    lines = []
    for turn in range(1, 6):
        for s in range(6):
            hashes = [s * 100 + k for k in range(turn + 1)]
            lines.append(req(turn * 10 + s, hashes, session=f"s{s}", turn=turn))
    trace = list(read_trace(write_trace(tmp_path / "s.jsonl", lines)))
    sim = ClusterSim(ClusterSpec(instances=3, gpu_blocks=1000, dram_blocks=0, routing="sticky"))
    homes: dict[str, set[int]] = {}
    sessions = {f"s{s}": s for s in range(6)}
    for r in trace:
        instance, _ = sim.step(r, sessions[r.session_id or ""])
        homes.setdefault(r.session_id or "", set()).add(instance)
    assert all(len(h) == 1 for h in homes.values())
    assert len(set().union(*homes.values())) == 3  # sessions spread by load at first turn
    # After each session's first turn, everything but the newest block is a GPU hit.
    assert sim.blocks["gpu"] == sum(len(r.hash_ids) - 1 for r in trace if r.turn != 1)


def test_sweep_reports_one_run_per_spec(shared: list[TraceRequest]) -> None:
    specs = sweep_specs(
        ClusterSpec(instances=2),
        gpu_blocks=[100, 1000],
        dram_blocks=[0, 5000],
        routings=["round-robin", "sticky"],
    )
    assert len(specs) == 8
    reports = simulate(shared[:800], specs, derive_sessions=True)
    assert [r["spec"]["gpu_blocks"] for r in reports[:2]] == [100, 1000]
    by = {
        (r["spec"]["gpu_blocks"], r["spec"]["dram_blocks"], r["spec"]["routing"]): r
        for r in reports
    }
    for routing in ("round-robin", "sticky"):
        # More capacity never serves fewer blocks from cache here.
        assert (
            by[(1000, 5000, routing)]["total_hit_ratio"] >= by[(100, 0, routing)]["total_hit_ratio"]
        )


def test_cli_simulate_and_capacity_plots(tmp_path: Path) -> None:
    runner = CliRunner()
    sim_png, cap_png = tmp_path / "sim.png", tmp_path / "cap.png"
    result = runner.invoke(
        app,
        [
            "trace",
            "simulate",
            str(SHARED_TRACE),
            "--gpu-blocks",
            "200,2000",
            "--dram-blocks",
            "0,4000",
            "--routing",
            "round-robin",
            "--plot",
            str(sim_png),
            "--no-progress",
            "--json",
            str(tmp_path / "s.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "local_dram" in result.output
    assert sim_png.read_bytes()[:4] == b"\x89PNG"
    result = runner.invoke(
        app,
        [
            "trace",
            "capacity",
            str(SHARED_TRACE),
            "--capacities",
            "1000,30000",
            "--plot",
            str(cap_png),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "0.0825" in result.output and "0.6242" in result.output
    assert cap_png.read_bytes()[:4] == b"\x89PNG"
    bad = runner.invoke(app, ["trace", "simulate", str(SHARED_TRACE), "--routing", "nope"])
    assert bad.exit_code == 2 and "unknown routing policy" in bad.output


@pytest.mark.parametrize(("credit", "where"), [(1.0, 0), (0.0, 1)])
def test_dram_credit_weighs_dram_hits_in_routing(credit: float, where: int) -> None:
    spec = ClusterSpec(
        instances=2,
        instances_per_node=1,
        gpu_blocks=0,
        dram_blocks=100,
        routing="cache-aware",
        dram_credit=credit,
        remote=False,
    )
    sim = ClusterSim(spec)
    a = TraceRequest(timestamp=0, input_length=5000, output_length=10, hash_ids=list(range(10)))
    b = TraceRequest(timestamp=1, input_length=5500, output_length=10, hash_ids=list(range(11)))
    assert sim.step(a, 0)[0] == 0  # a tie: the first instance; it is busy prefilling now
    # With credit, b follows its prefix into node 0's DRAM; without, the idle instance wins.
    assert sim.step(b, 0)[0] == where


def _heavy_burst(n: int, tail_blocks: int) -> list[TraceRequest]:
    """One session's prefix (10 blocks), then ``n`` requests extending it with new blocks,
    all within a few ms: cache affinity sends them all to the prefix's instance."""
    first = TraceRequest(timestamp=0, input_length=10 * 512, output_length=1, hash_ids=[*range(10)])
    return [first] + [
        TraceRequest(
            timestamp=1000 + i,
            input_length=(10 + tail_blocks) * 512,
            output_length=10,
            hash_ids=[*range(10), *range(100 * (i + 1), 100 * (i + 1) + tail_blocks)],
        )
        for i in range(n)
    ]


def test_offload_moves_heavy_prefills_off_a_busy_home() -> None:
    """The router's gate in the simulator: heavy prompts queued behind each other at the
    prefix's instance prefill on the idle one instead (at most ``offload_max_concurrent`` at
    a time), which lowers the modelled TTFT; every block is still counted once; light prompts
    never move."""
    base = ClusterSpec(instances=2, instances_per_node=2, gpu_blocks=1000, dram_blocks=1000,
                       routing="cache-aware")  # fmt: skip
    trace = _heavy_burst(6, tail_blocks=20)
    off, on = simulate(trace, sweep_specs(base, offloads=[False, True]), derive_sessions=False)
    assert off["offloads"] == 0 and "offloaded" not in off["routing_decisions"]
    assert 1 <= on["offloads"] <= base.offload_max_concurrent
    assert on["routing_decisions"]["offloaded"] == on["offloads"]
    assert on["modelled_ttft_s"]["p90"] < off["modelled_ttft_s"]["p90"]
    blocks = sum(len(r.hash_ids) for r in trace)
    for report in (off, on):
        total = report["requests"]
        assert total == len(trace)
        assert sum(report["hit_ratio_blocks"].values()) == pytest.approx(1.0)
    sim = ClusterSim(ClusterSpec(**{**base.__dict__, "offload": True}))
    served = [sim.step(r, 0)[1] for r in trace]
    assert sum(sum(c) for c in served) == blocks
    light = ClusterSim(ClusterSpec(**{**base.__dict__, "offload": True}))
    for r in _heavy_burst(6, tail_blocks=4):  # 2k new tokens each: under offload_min_tokens
        light.step(r, 0)
    assert light.offloads == 0
