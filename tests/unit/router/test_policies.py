"""Routing policies (kvtier.router.policies): each formula against hand-computed choices and
scores, and the simulator's adapter (traces/routing.py) that feeds them."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvtier.core.costs import DEFAULT_KAPPA
from kvtier.router.policies import (
    POLICIES,
    CacheAware,
    Candidate,
    Coverage,
    Hybrid,
    Kvtier,
    LeastLoad,
    LMetric,
    Load,
    RoundRobin,
    RouteRequest,
    Sticky,
    TierCosts,
    make_policy,
)
from kvtier.traces.formats import TraceRequest
from kvtier.traces.routing import SimRouter, coverage_from_blocks
from kvtier.traces.simulate import ClusterSim, ClusterSpec, simulate


def cand(
    name: str,
    pending: float = 0.0,
    running: int = 0,
    gpu: int = 0,
    dram: int | None = None,
    remote: int | None = None,
) -> Candidate:
    """A candidate; ``dram``/``remote`` default to the tier below (cumulative coverage)."""
    dram = gpu if dram is None else dram
    remote = dram if remote is None else remote
    return Candidate(name, Load(pending, running), Coverage(gpu, dram, remote))


def req(tokens: int, session: str | None = None) -> RouteRequest:
    return RouteRequest(tokens, session)


# -- Coverage ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "dram", "remote"),
    [(10, 5, 20), (0, 10, 5), (-1, 0, 0), (5, 0, 0), (10, 20, 15)],
)
def test_coverage_rejects_non_cumulative_values(gpu: int, dram: int, remote: int) -> None:
    with pytest.raises(ValueError, match="cumulative"):
        Coverage(gpu, dram, remote)


def test_coverage_accepts_cumulative_values() -> None:
    assert Coverage() == Coverage(0, 0, 0)
    assert Coverage(5, 5, 5).remote == 5
    assert Coverage(0, 0, 7).remote == 7


# -- round-robin, least-load -----------------------------------------------------------------


def test_round_robin_cycles_blind_to_load_and_cache() -> None:
    policy = RoundRobin()
    cs = [cand("a", pending=1e9), cand("b", gpu=4000), cand("c")]
    picks = [policy.choose(req(4000), cs) for _ in range(4)]
    assert [d.index for d in picks] == [0, 1, 2, 0]
    assert {d.reason for d in picks} == {"round-robin"}
    # The counter wraps on the current list: fewer candidates next time still stays in range.
    assert policy.choose(req(4000), cs[:2]).index == 0  # call 5 -> 4 % 2


def test_least_load_pending_then_running_then_name() -> None:
    cs = [cand("a", 100, 0), cand("b", 50, 5), cand("c", 50, 2)]
    d = LeastLoad().choose(req(10), cs)
    assert (d.index, d.reason, d.scores) == (2, "least-load", (100.0, 50.0, 50.0))
    assert LeastLoad().choose(req(10), [cand("b", 5, 1), cand("a", 5, 1)]).index == 1


# -- sticky ----------------------------------------------------------------------------------


def test_sticky_keeps_a_session_home_while_not_overloaded() -> None:
    policy = Sticky()
    first = policy.choose(req(10, "s"), [cand("a", 50), cand("b", 0), cand("c", 10)])
    assert (first.index, first.reason) == (1, "new-session")
    # b is now the most loaded, at exactly 2x the average (600 / 3 = 200): stays.
    again = policy.choose(req(10, "s"), [cand("a", 100), cand("b", 400), cand("c", 100)])
    assert (again.index, again.reason) == (1, "sticky")
    # Candidates in another order: the home is found by name.
    moved = policy.choose(req(10, "s"), [cand("b", 0), cand("a", 0), cand("c", 0)])
    assert (moved.index, moved.reason) == (0, "sticky")


def test_sticky_overload_override_at_twice_the_average() -> None:
    policy = Sticky()
    assert policy.choose(req(10, "s"), [cand("a"), cand("b", 1)]).index == 0  # home a
    # a: 300 pending, average 100, 300 > 2 x 100: moves to the least loaded (c, by name).
    d = policy.choose(req(10, "s"), [cand("a", 300), cand("b", 0), cand("c", 0)])
    assert (d.index, d.reason) == (1, "overloaded")
    # The session's home is now b.
    d = policy.choose(req(10, "s"), [cand("a", 10), cand("b", 10), cand("c", 0)])
    assert (d.index, d.reason) == (1, "sticky")


def test_sticky_overload_falls_back_to_running_requests() -> None:
    policy = Sticky()
    policy.choose(req(10, "s"), [cand("a"), cand("b", running=1), cand("c", running=1)])
    # No pending tokens anywhere: running counts. a 4, average 2: 4 is not > 4, stays.
    stay = policy.choose(req(10, "s"), [cand("a", 0, 4), cand("b", 0, 2), cand("c", 0, 0)])
    assert (stay.index, stay.reason) == (0, "sticky")
    # a 5, average 2: 5 > 4, moves to c.
    move = policy.choose(req(10, "s"), [cand("a", 0, 5), cand("b", 0, 1), cand("c", 0, 0)])
    assert (move.index, move.reason) == (2, "overloaded")


def test_sticky_without_session_or_home_and_forgetting() -> None:
    policy = Sticky(max_sessions=2)
    d = policy.choose(req(10), [cand("a", 5), cand("b", 1)])
    assert (d.index, d.reason) == (1, "no-session")
    policy.choose(req(10, "s"), [cand("a", 5), cand("b", 1)])  # home b
    d = policy.choose(req(10, "s"), [cand("a", 5), cand("c", 9)])
    assert (d.index, d.reason) == (0, "home-unavailable")  # b gone: least loaded, new home a
    assert policy.choose(req(10, "s"), [cand("a", 5), cand("c", 0)]).reason == "sticky"
    policy.choose(req(10, "t"), [cand("a"), cand("c")])
    policy.choose(req(10, "u"), [cand("a"), cand("c")])  # 3 sessions > 2: s forgotten
    assert policy.choose(req(10, "s"), [cand("a", 5), cand("c", 0)]).reason == "new-session"


# -- cache-aware -----------------------------------------------------------------------------


def test_cache_aware_longest_prefix_with_dram_credit() -> None:
    cs = [cand("a", gpu=1000), cand("b", gpu=0, dram=3000), cand("c", gpu=0, dram=0, remote=4000)]
    # credit 0.5: a 1000, b 0.5 x 3000 = 1500, c 0 (remote ignored)
    d = CacheAware(0.5).choose(req(4000), cs)
    assert (d.index, d.reason, d.scores) == (1, "longest-prefix", (-1000.0, -1500.0, -0.0))
    # credit 0.25: b 750 < a 1000
    assert CacheAware(0.25).choose(req(4000), cs).index == 0


def test_cache_aware_ties_by_load_then_name_and_makes_hot_spots() -> None:
    cs = [cand("a", 100, gpu=1000), cand("b", 50, gpu=1000), cand("c", 50, 1, gpu=1000)]
    assert CacheAware().choose(req(4000), cs).index == 1
    # Affinity alone: however loaded the holder, it wins.
    cs = [cand("a", 1e6, 50, gpu=1000), cand("b")]
    assert CacheAware().choose(req(4000), cs).index == 0


# -- lmetric ---------------------------------------------------------------------------------


def test_lmetric_score() -> None:
    cs = [
        cand("a", 0, 3, gpu=3000),  # (0 + 1000) x 4 = 4000
        cand("b", 1000, 0),  # (1000 + 4000) x 1 = 5000
        cand("c", 0, 1, gpu=0, dram=2000),  # (0 + 4000 - 0.5 x 2000) x 2 = 6000
    ]
    d = LMetric(0.5).choose(req(4000), cs)
    assert (d.index, d.reason, d.scores) == (0, "score", (4000.0, 5000.0, 6000.0))
    # Coverage beyond the prompt counts as the whole prompt.
    assert LMetric().score(cand("x", 10, 1, gpu=5000), 4000) == 20.0
    assert LMetric(1.0).uncached(cand("x", gpu=1000, dram=9000), 4000) == 0.0


def test_lmetric_ties_by_uncached_then_name() -> None:
    # Same score 4000: a (pending 2000, uncached 2000) vs b (pending 0, uncached 4000).
    cs = [cand("b", 0, 0), cand("a", 2000, 0, gpu=2000)]
    assert LMetric().choose(req(4000), cs).index == 1
    cs = [cand("b", 0, 0), cand("a", 0, 0)]
    assert LMetric().choose(req(4000), cs).index == 1


# -- hybrid ----------------------------------------------------------------------------------


def test_hybrid_affinity_gate_keeps_the_gpu_holder() -> None:
    # a holds 2500 of 4000 tokens (> 50 %) in GPU; lmetric prefers b. Pending average 1000,
    # a's 2000 is not above 2 x 1000: the gate keeps a.
    cs = [cand("a", 2000, 1, gpu=2500), cand("b", 0, 0), cand("c", 1000, 0)]
    d = Hybrid().choose(req(4000), cs)
    assert LMetric().choose(req(4000), cs).index == 1
    assert (d.index, d.reason, d.scores) == (0, "affinity", (7000.0, 4000.0, 5000.0))


def test_hybrid_gate_yields_when_overloaded_or_half_or_less() -> None:
    overloaded = [cand("a", 3000, 1, gpu=2500), cand("b", 0, 0), cand("c", 1000, 0)]
    d = Hybrid().choose(req(4000), overloaded)  # average 1333, a's 3000 > 2667
    assert (d.index, d.reason) == (1, "score")
    half = [cand("a", 2000, 1, gpu=2000), cand("b", 0, 0), cand("c", 1000, 0)]
    assert Hybrid().choose(req(4000), half).index == 1  # exactly 50 % is not > 50 %
    # The gate counts GPU only: a DRAM-held prompt does not pin.
    dram = [cand("a", 2000, 1, gpu=0, dram=4000), cand("b", 0, 0), cand("c", 1000, 0)]
    assert Hybrid().choose(req(4000), dram).index == 1


# -- kvtier: kappa ---------------------------------------------------------------------------


def test_kappa_interpolates_in_log_length_and_is_flat_beyond() -> None:
    costs = TierCosts({"dram": {1000: 0.5, 10000: 0.9}})
    assert costs.kappa("dram", 1000) == 0.5
    assert costs.kappa("dram", 10000) == pytest.approx(0.9)
    assert costs.kappa("dram", round(math.sqrt(1000 * 10000))) == pytest.approx(0.7, abs=1e-4)
    assert costs.kappa("dram", 2000) == pytest.approx(0.5 + 0.4 * math.log(2) / math.log(10))
    assert costs.kappa("dram", 10) == 0.5  # flat below the first point
    assert costs.kappa("dram", 0) == 0.5
    assert costs.kappa("dram", 10**6) == 0.9  # flat beyond the last


def test_kappa_clamped_and_zero_for_a_missing_tier() -> None:
    costs = TierCosts({"dram": {100: 1.5, 1000: -0.2}})
    assert costs.kappa("dram", 100) == 1.0
    assert costs.kappa("dram", 1000) == 0.0  # slower than recompute: 0, never negative
    assert 0.0 <= costs.kappa("dram", 300) <= 1.0
    assert costs.kappa("remote", 5000) == 0.0  # not measured: no credit
    assert TierCosts({}).uncached(Coverage(0, 100, 200), 300) == 300.0


def test_kappa_defaults_and_bad_tables() -> None:
    costs = TierCosts()
    for tier, points in DEFAULT_KAPPA.items():
        for n, k in points.items():
            assert costs.kappa(tier, n) == pytest.approx(k)
    with pytest.raises(ValueError):
        TierCosts({"dram": {}})
    with pytest.raises(ValueError):
        TierCosts({"dram": {0: 0.5}})


def test_kvtier_prices_each_tier() -> None:
    costs = TierCosts({"dram": {1: 0.9}, "remote": {1: 0.5}})
    # 1000 GPU (free) + 2000 DRAM x 0.1 + 1000 remote x 0.5 + 1000 missed
    assert costs.uncached(Coverage(1000, 3000, 4000), 5000) == pytest.approx(1700.0)
    policy = Kvtier(costs)
    c = cand("a", 300, 1, gpu=1000, dram=3000, remote=4000)
    assert policy.score(c, 5000) == pytest.approx((300 + 1700) * 2)
    # Coverage is capped at the prompt.
    assert costs.uncached(Coverage(6000, 6000, 6000), 5000) == 0.0


# -- kvtier: the tier pricing's consequences --------------------------------------------------


def test_kvtier_dram_prefix_is_warm_on_the_whole_node_so_load_decides() -> None:
    """A shared 8000-token system prompt in the node's DRAM; a's GPU also holds it, and a is
    busy. Every instance of the node is nearly warm (8000 x (1 - 0.96) + 192 = 512)."""
    cs = [
        cand("a", 20000, 3, gpu=8000),
        cand("b", 100, 0, gpu=0, dram=8000),
        cand("c", 0, 1, gpu=0, dram=8000),
        cand("d", 0, 0, gpu=0, dram=8000),
    ]
    d = Kvtier().choose(req(8192), cs)
    assert d.scores == pytest.approx((20192 * 4, 612, 1024, 512))
    assert (d.index, d.reason) == (3, "score")  # the least loaded: load decides
    assert CacheAware().choose(req(8192), cs).index == 0  # affinity alone: the busy holder


def test_kvtier_shared_system_prompt_is_not_a_hot_spot() -> None:
    """40 requests behind one DRAM-held prefix: kvtier spreads them over the node's 4
    instances; cache-aware sends all to the GPU holder."""

    def route(policy_name: str) -> Counter[str]:
        policy = make_policy(policy_name)
        pending = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}
        count: Counter[str] = Counter()
        for _ in range(40):
            cs = [
                cand(n, pending[n], gpu=8000 if n == "a" else 0, dram=8000) for n in sorted(pending)
            ]
            d = policy.choose(req(8192), cs)
            name = cs[d.index].name
            count[name] += 1
            pending[name] += 1000
        return count

    spread = route("kvtier")
    assert set(spread) == {"a", "b", "c", "d"}
    assert max(spread.values()) - min(spread.values()) <= 2
    assert route("cache-aware") == Counter({"a": 40})


def test_kvtier_prices_the_nodes_disk_only_where_measured() -> None:
    """A prefix on the node's disk: priced at (1 - kappa disk) where the table measured the
    disk tier, and as a recompute where it did not (the defaults know no disk)."""
    on_disk = Candidate("a", Load(), Coverage(0, 1000, 8000, disk=8000))
    cold = cand("b")
    measured = TierCosts({**DEFAULT_KAPPA, "disk": {8192: 0.75}})
    # 1000 DRAM x 0.04 + 7000 disk x 0.25 + 192 missed
    assert measured.uncached(on_disk.coverage, 8192) == pytest.approx(40 + 1750 + 192)
    assert Kvtier(measured).choose(req(8192), [cold, on_disk]).index == 1
    assert TierCosts().uncached(on_disk.coverage, 8192) == pytest.approx(40 + 7000 + 192)
    with pytest.raises(ValueError, match="cumulative"):
        Coverage(0, 0, 100, disk=200)  # remote covers at least what the node's disk does


def test_kvtier_remote_prefix_priced_at_one_minus_kappa_remote() -> None:
    # Default kappa at 8192 tokens: DRAM 0.96, remote 0.82.
    local = cand("a", 0, 0, gpu=0, dram=8000)  # 8000 x 0.04 + 192 = 512
    remote = cand("b", 0, 0, gpu=0, dram=0, remote=8000)  # 8000 x 0.18 + 192 = 1632
    cold = cand("c", 0, 0)  # 8192
    d = Kvtier().choose(req(8192), [local, remote, cold])
    assert d.scores == pytest.approx((512.0, 1632.0, 8192.0))
    assert d.index == 0
    # The node holding it locally is busier by more than the fetch price: remote wins.
    busy = cand("a", 1200, 0, gpu=0, dram=8000)
    assert Kvtier().choose(req(8192), [busy, remote, cold]).index == 1


def test_kvtier_gate_margin() -> None:
    costs = TierCosts({"dram": {1: 0.5}})  # a DRAM token costs half a recompute
    # a: whole prompt in GPU, pending P -> score P. b: whole prompt in DRAM, idle -> 2000.
    for pending, margin, expected in [
        (2200.0, 0.1, (0, "affinity")),  # 2000 >= 0.9 x 2200 = 1980: not better by 10 %
        (2300.0, 0.1, (1, "score")),  # 2000 < 0.9 x 2300 = 2070
        (2200.0, 0.0, (1, "score")),  # no margin: the lower score wins
        (1900.0, 0.1, (0, "score")),  # the holder is the best anyway
    ]:
        cs = [cand("a", pending, gpu=4000), cand("b", gpu=0, dram=4000)]
        d = Kvtier(costs, gate_margin=margin).choose(req(4000), cs)
        assert (d.index, d.reason) == expected, (pending, margin)
        assert d.scores == pytest.approx((pending, 2000.0))
    # The gate needs > 50 % of the prompt in the holder's GPU. a: 2100 + 2000 x 0.5 = 3100,
    # b: 2000 >= 0.5 x 3100, so a gate with margin 0.5 would keep a; at exactly 50 % it is off.
    cs = [cand("a", 2100, gpu=2000, dram=4000), cand("b", gpu=0, dram=4000)]
    assert Kvtier(costs, gate_margin=0.5).choose(req(4000), cs).index == 1
    cs = [cand("a", 2100, gpu=2001, dram=4000), cand("b", gpu=0, dram=4000)]
    assert Kvtier(costs, gate_margin=0.5).choose(req(4000), cs).reason == "affinity"


# -- every policy ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_deterministic_tie_break(name: str) -> None:
    """Identical candidates: the same one wins whatever order they come in and whichever
    replica asks (nothing depends on history); without a tie key, the first name."""
    same = dict(pending=100.0, running=1, gpu=1000, dram=2000, remote=3000)
    for session in ("s", "t", None):
        winners = set()
        for order in (["c", "a", "b"], ["b", "c", "a"], ["a", "b", "c"]):
            cs = [cand(n, **same) for n in order]  # type: ignore[arg-type]
            d = make_policy(name).choose(req(4000, session), cs)
            if name == "round-robin":
                assert d.index == 0  # in turn, not by name
            winners.add(cs[d.index].name)
        if name != "round-robin":
            assert len(winners) == 1, (name, session, winners)
            if session is None:
                assert winners == {"a"}


@pytest.mark.parametrize(
    "name", ["least-load", "sticky", "cache-aware", "lmetric", "hybrid", "kvtier"]
)
def test_exact_ties_spread_over_instances_by_session(name: str) -> None:
    """Idle instances, cold prompts (the low-load case that piled everything on the first name):
    sessions spread evenly by rendezvous hash, and a session's ties keep meeting the same one."""
    policy = make_policy(name)
    cs = [cand(n) for n in ("a", "b", "c", "d")]
    first = {f"s{i}": cs[policy.choose(req(4000, f"s{i}"), cs).index].name for i in range(400)}
    counts = Counter(first.values())
    assert set(counts) == {"a", "b", "c", "d"} and min(counts.values()) >= 70, counts
    again = {s: cs[policy.choose(req(4000, s), cs).index].name for s in first}
    assert again == first
    # No session: the prompt's own spread key (the router's: length and last tokens).
    keyed = Counter(
        cs[policy.choose(RouteRequest(4000, None, f"p{i}"), cs).index].name for i in range(400)
    )
    assert min(keyed.values()) >= 70, keyed


def test_make_policy_names() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.name == name
        assert make_policy(name) is not policy  # fresh state
    assert isinstance(make_policy("kvtier", costs=TierCosts({})), Kvtier)
    assert make_policy("lmetric", dram_credit=1.0).dram_credit == 1.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


# -- the simulator's adapter -----------------------------------------------------------------


def test_coverage_from_blocks_is_cumulative_tokens_capped_at_the_prompt() -> None:
    assert coverage_from_blocks((2, 1, 1), 2000, 512) == Coverage(1024, 1536, 2000)
    assert coverage_from_blocks((4, 0, 0), 2000, 512) == Coverage(2000, 2000, 2000)
    assert coverage_from_blocks((0, 0, 0), 2000, 512) == Coverage()


def test_adapter_builds_candidates_from_cluster_state() -> None:
    """2 nodes x 1 instance, no GPU cache: after a request on node 0, node 0's instance holds
    it in DRAM and node 1's reads it remotely; load is the prefill backlog."""
    spec = ClusterSpec(instances=2, instances_per_node=1, gpu_blocks=0, dram_blocks=100)
    sim = ClusterSim(spec, make_policy("kvtier"))
    a = TraceRequest(timestamp=0, input_length=1500, output_length=10, hash_ids=[1, 2, 3])
    first = sim.step(a)[0]  # idle instances, a cold prompt: an exact tie, spread by hash
    other = 1 - first
    runs = [(0, 0, 0), (0, 0, 0)]
    runs[first], runs[other] = (0, 3, 0), (0, 0, 3)
    assert sim.tier_runs([1, 2, 3, 4]) == runs
    cs = sim.router.candidates(sim, [1, 2, 3, 4], 2000, now=0.0)
    assert [c.name for c in cs] == ["i0", "i1"]
    assert cs[first].coverage == Coverage(0, 1536, 1536)  # 3 blocks of 512 of 2000 tokens
    assert cs[other].coverage == Coverage(0, 0, 1536)
    # It is prefilling 1500 tokens at 10k tokens/s: 0.15 s of backlog at t=0.
    assert cs[first].load == Load(1500.0, 1)
    assert cs[other].load == Load(0.0, 0)
    # Cache-blind policies get no coverage.
    blind = SimRouter(make_policy("least-load"), 2, 512)
    assert all(c.coverage == Coverage() for c in blind.candidates(sim, [1, 2, 3], 1500, 0.0))


def test_adapter_names_sort_in_instance_order() -> None:
    names = SimRouter(RoundRobin(), 12, 512).names
    assert names == sorted(names) and names[0] == "i00" and names[11] == "i11"


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_runs_in_the_simulator(name: str) -> None:
    trace = [
        TraceRequest(
            timestamp=10 * i,
            input_length=8 * 512,
            output_length=20,
            hash_ids=[*range(6), 100 + i, 200 + i],
        )
        for i in range(40)
    ]
    spec = ClusterSpec(instances=4, instances_per_node=2, gpu_blocks=200, dram_blocks=400)
    (report,) = simulate(
        trace, [ClusterSpec(**{**spec.__dict__, "routing": name})], derive_sessions=True
    )
    assert report["requests"] == 40
    assert sum(report["routing_decisions"].values()) == 40


def test_simulated_kvtier_spreads_a_shared_prefix_cache_aware_piles_it() -> None:
    # One node of 4 instances with a DRAM pool; 40 requests behind one 10-block prefix.
    trace = [
        TraceRequest(
            timestamp=i,
            input_length=20 * 512,
            output_length=50,
            hash_ids=[*range(10), *range(1000 + 10 * i, 1010 + 10 * i)],
        )
        for i in range(40)
    ]
    base = ClusterSpec(instances=4, instances_per_node=4, gpu_blocks=10_000, dram_blocks=10_000)
    aware, kvtier = simulate(
        trace,
        [ClusterSpec(**{**base.__dict__, "routing": r}) for r in ("cache-aware", "kvtier")],
        derive_sessions=True,
    )
    assert sorted(aware["load"]["requests_per_instance"]) == [0, 0, 0, 40]
    assert max(kvtier["load"]["requests_per_instance"]) <= 12
    assert kvtier["modelled_ttft_s"]["p90"] < aware["modelled_ttft_s"]["p90"]
