"""``kvtier bench cluster``: the trace made small (sampling, cut, cap), the figures (tier hits,
per-instance load, the router's decision histogram) and the report, in ~4 s. The ``--quick``
run on real processes (index, stores, vLLM CPU servers, router), which asserts behaviour, not
timings: tests/engine/test_bench_cluster.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier.bench.cluster import figures as cluster_figures
from kvtier.bench.cluster import report as cluster_report
from kvtier.bench.cluster import run as cluster
from kvtier.bench.cluster.trace import TracePlan, prepare
from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace
from kvtier.testing.fleet import events_namespace
from kvtier.testing.models import make_model
from kvtier.traces.formats import TraceFormat, TraceReader, TraceRequest, TraceWriter
from kvtier.traces.replay import ReplayResult
from kvtier.traces.sample import SampleOptions

MOONCAKE = Path("/work/shared/data/traces/mooncake_synthetic_trace.jsonl")


def _write_trace(path: Path) -> Path:
    """Two sessions sharing a 3-block system prompt; one long prompt (10 blocks)."""
    reqs = [
        TraceRequest(timestamp=0, input_length=4 * 512, output_length=50,
                     hash_ids=[1, 2, 3, 10], session_id="a", turn=1),
        TraceRequest(timestamp=500, input_length=4 * 512 - 100, output_length=5,
                     hash_ids=[1, 2, 3, 20], session_id="b", turn=1),
        TraceRequest(timestamp=900, input_length=10 * 512, output_length=7,
                     hash_ids=[1, 2, 3, 10, 11, 12, 13, 14, 15, 16], session_id="a", turn=2),
        TraceRequest(timestamp=2000, input_length=512, output_length=3,
                     hash_ids=[99], session_id="c", turn=1),
    ]  # fmt: skip
    with TraceWriter(path, TraceFormat.SESSION) as w:
        for r in reqs:
            w.write(r)
    return path


def test_prepare_caps_prompts_keeping_their_shared_prefix(tmp_path: Path) -> None:
    src = _write_trace(tmp_path / "src.jsonl")
    plan = TracePlan(path=src, block_tokens=16, max_prompt_tokens=100, max_output_tokens=8)
    out, report = prepare(plan, tmp_path / "run", vocab_size=512)
    reqs = list(TraceReader(out, TraceFormat.SESSION))
    assert [r.session_id for r in reqs] == ["a", "b", "a", "c"]
    assert [r.hash_ids for r in reqs] == [[1, 2, 3, 10], [1, 2, 3, 20], [1, 2, 3, 10, 11, 12], [99]]
    assert report["capped_requests"] == 1  # 10 blocks x 16 tokens > 100: 6 blocks left
    assert report["prompt_tokens"]["max"] == 96
    assert report["output_tokens"]["max"] == 8
    assert report["scale"]["length_scale"] == 16 / 512
    assert report["requests"] == 4 and report["sessions"] == 3
    assert report["infinite_cache_hit_ratio"] > 0
    warm, medium, heavy = report["classes"]  # 5000 / 20000 trace tokens, x 1/32 sent
    assert (warm["below_sent_tokens"], medium["below_sent_tokens"]) == (156, 625)
    assert heavy["below_sent_tokens"] is None

    limited, rep = prepare(
        TracePlan(path=src, limit=2, time_scale=0.5), tmp_path / "lim", vocab_size=512
    )
    assert len(list(TraceReader(limited, TraceFormat.SESSION))) == 2
    assert rep["duration_s"] == pytest.approx(0.25)


def test_prepare_refuses_an_empty_sample_and_bad_plans(tmp_path: Path) -> None:
    src = _write_trace(tmp_path / "src.jsonl")
    opts = SampleOptions(window_seconds=1, window_start_seconds=100)
    with pytest.raises(KvtierError):
        prepare(TracePlan(path=src, sample=opts), tmp_path / "run", vocab_size=512)
    with pytest.raises(KvtierError):
        TracePlan(block_tokens=32, max_prompt_tokens=16)
    with pytest.raises(KvtierError):
        TracePlan(time_scale=0)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared trace is not here")
def test_sampling_the_shared_trace_keeps_cross_session_sharing(tmp_path: Path) -> None:
    plan = TracePlan(sample=SampleOptions(window_seconds=120, sample_ratio=0.5, seed=0))
    _, report = prepare(plan, tmp_path, vocab_size=512)
    assert report["requests"] > 50
    assert report["cross_session_hit_share"] > 0.2
    assert report["prompt_tokens"]["max"] <= plan.max_prompt_tokens


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.001, 10.0), (0.002, 30.0), (0.005, 40.0), (float("inf"), 40.0)]
    assert cluster_figures.histogram_quantile(buckets, 0.25) == pytest.approx(0.001)
    assert cluster_figures.histogram_quantile(buckets, 0.5) == pytest.approx(0.0015)
    assert cluster_figures.histogram_quantile(buckets, 0.875) == pytest.approx(0.0035)
    assert cluster_figures.histogram_quantile([(float("inf"), 0.0)], 0.5) is None
    over = [(0.001, 1.0), (float("inf"), 4.0)]
    assert cluster_figures.histogram_quantile(over, 0.99) == 0.001  # past the top bound: the bound


def test_decision_latency_from_the_histogram_and_the_log(tmp_path: Path) -> None:
    name = cluster_figures.DECISION
    before = {f"{name}_bucket{{le=0.001}}": 5.0, f"{name}_bucket{{le=+Inf}}": 5.0,
              f"{name}_count": 5.0, f"{name}_sum": 0.002}  # fmt: skip
    after = {f"{name}_bucket{{le=0.001}}": 15.0, f"{name}_bucket{{le=+Inf}}": 25.0,
             f"{name}_count": 25.0, f"{name}_sum": 0.042}  # fmt: skip
    log = tmp_path / "decisions.jsonl"
    log.write_text(
        "\n".join(
            json.dumps({"t": t, "decision_ms": ms}) for t, ms in [(1, 9.0), (5, 1.0), (6, 3.0)]
        )
    )
    out = cluster_figures.decision_latency(before, after, tmp_path, since=2)
    assert out["count"] == 20 and out["mean_s"] == pytest.approx(0.002)
    assert out["p50_s"] == pytest.approx(0.001)
    assert out["log"]["decisions"] == 2 and out["log"]["max_ms"] == 3.0


def _counters(prompt: float, device: float, host: float, done: float) -> dict[str, float]:
    c = cluster_figures.CACHED
    return {"vllm:prompt_tokens_total": prompt, "vllm:request_success_total": done,
            f"{c}{{source=device}}": device, f"{c}{{source=host}}": host}  # fmt: skip


def _result(instance: str) -> ReplayResult:
    res = ReplayResult(index=0, session="s", turn=1, cls="WARM", warmup=False, status="ok",
                       scheduled_s=0.0, meta={"instance": instance})  # fmt: skip
    return res


def test_tier_hits_instances_and_imbalance() -> None:
    before = {"i0": _counters(100, 0, 0, 1), "i1": _counters(100, 0, 0, 1)}
    after = {"i0": _counters(1100, 300, 200, 11), "i1": _counters(2100, 500, 0, 21)}
    tiers = cluster_figures.tier_hits(before, after)
    assert tiers["prompt_tokens"] == 3000
    assert tiers["ratio"]["device"] == pytest.approx(800 / 3000)
    assert tiers["dram_ratio"] == pytest.approx(200 / 3000)
    assert tiers["hit_ratio"] == pytest.approx(1000 / 3000)
    results = [_result("i0"), _result("i1"), _result("i1"), _result("")]
    inst = cluster_figures.instance_figures(before, after, results)
    assert inst["i0"]["hit_ratio"] == pytest.approx(0.5)
    assert inst["i1"]["computed_tokens"] == 1500 and inst["i1"]["engine_requests"] == 20
    assert (inst["i0"]["requests"], inst["i1"]["requests"]) == (1, 2)  # by the router's header
    imb = cluster_figures.imbalance(inst)
    assert imb["requests"] == pytest.approx(2 / 1.5)
    assert imb["computed_tokens"] == pytest.approx(1500 / 1000)


def test_engine_steps_preemptions_and_hook_time_per_step() -> None:
    hooks = cluster_figures.HOOK_SECONDS
    before = {"i0": {cluster_figures.STEPS: 100.0, hooks["worker"]: 1.0},
              "i1": {cluster_figures.STEPS: 50.0}}  # fmt: skip
    after = {"i0": {cluster_figures.STEPS: 600.0, hooks["worker"]: 2.5,
                    hooks["scheduler"]: 0.5, cluster_figures.PREEMPTIONS: 2.0},
             "i1": {cluster_figures.STEPS: 550.0, hooks["worker"]: 0.5}}  # fmt: skip
    eng = cluster_figures.engine_figures(before, after)
    assert eng["steps"] == 1000 and eng["preemptions"] == 2
    assert eng["hook_seconds"] == {"scheduler": 0.5, "worker": 2.0}
    assert eng["hook_ms_per_step"] == {"scheduler": 0.5, "worker": 2.0}
    assert cluster_figures.engine_figures({"i": {}}, {"i": {}})["hook_ms_per_step"]["worker"] == 0


def test_hits_and_long_misses_are_split() -> None:
    def done(
        ttft: float, prompt: int, cached: int, warmup: bool = False, status: str = "ok"
    ) -> ReplayResult:
        return ReplayResult(index=0, session="s", turn=1, cls="WARM", warmup=warmup,
                            status=status, scheduled_s=0.0, ttft_s=ttft, prompt_tokens=prompt,
                            cached_tokens=cached)  # fmt: skip

    results = [
        done(0.05, 300, 128),  # a hit
        done(0.20, 400, 0),  # long misses: 0.5 and 1.0 ms a token
        done(0.30, 300, 0),
        done(0.10, 100, 0),  # a short miss: in neither group
        done(9.0, 500, 0, warmup=True),  # warm-up and failures: left out
        done(9.0, 500, 0, status="error"),
    ]
    split = cluster_figures.hit_split(results)
    assert split["hits"] == {"requests": 1, "ttft_s": {"p50": 0.05, "p90": 0.05}}
    misses = split["long_misses"]
    assert misses["requests"] == 2 and misses["ttft_s"]["p50"] == pytest.approx(0.25)
    assert misses["ms_per_token"]["p50"] == pytest.approx(0.75)
    assert cluster_figures.hit_split([])["hits"]["ttft_s"] == {"p50": None, "p90": None}


def test_configurations_are_wired_as_documented(tmp_path: Path) -> None:
    topo = cluster.Topology()
    rr = cluster.fleet_spec(cluster.CONFIGS["vllm-rr"], topo)
    assert (rr.kvtier, rr.kv_events, rr.policy) == (False, False, "round-robin")
    lm = cluster.fleet_spec(cluster.CONFIGS["vllm-lmetric"], topo)
    assert (lm.kvtier, lm.kv_events, lm.policy) == (False, True, "lmetric")
    kv = cluster.fleet_spec(cluster.CONFIGS["kvtier-kvtier"], topo)
    assert (kv.kvtier, kv.kv_events, kv.policy, kv.remote) == (True, True, "kvtier", True)
    assert kv.connector_extra["min_hit_tokens"] == {"cpu": 64, "remote": 128}
    # kvtier-rr differs from kvtier-kvtier in the routing policy alone
    krr = cluster.fleet_spec(cluster.CONFIGS["kvtier-rr"], topo)
    assert krr.policy == "round-robin" and dataclasses.replace(krr, policy="kvtier") == kv
    klm = cluster.fleet_spec(cluster.CONFIGS["kvtier-lmetric"], topo)
    assert klm.policy == "lmetric" and dataclasses.replace(klm, policy="kvtier") == kv
    assert cluster.CONFIGS["lmcache-lmetric"].peer == "lmcache"
    assert set(cluster.QUICK_CONFIGS) <= set(cluster.DEFAULT_CONFIGS) <= set(cluster.CONFIGS)
    for diagnostic in ("kvtier-rr", "kvtier-lmetric"):  # asked for by name
        assert diagnostic not in cluster.DEFAULT_CONFIGS
    model = make_model(tmp_path / "tiny", "tiny")
    ns = Namespace(**events_namespace(model, 64))
    assert (ns.num_layers, ns.num_kv_heads, ns.head_size, ns.chunk_tokens) == (2, 2, 32, 64)


def _fake_report() -> dict:
    group = {"requests": 3, "ok": 3, "errors": 0, "timeouts": 0,
             **{m: {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3}
                for m in ("ttft_s", "tpot_s", "e2e_s")}}  # fmt: skip
    tiers = {"ratio": {"device": 0.3, "host": 0.1, "p2p": 0.0, "external_unspecified": 0.0},
             "dram_ratio": 0.1, "hit_ratio": 0.4}  # fmt: skip
    inst = {"node0-vllm0": {"requests": 3, "computed_tokens": 10.0, "hit_ratio": 0.4}}
    conf = {**group, "label": "kvtier + kvtier", "classes": {"WARM": group}, "tiers": tiers,
            "imbalance": {"computed_tokens": 1.0}, "instances": inst,
            "router_decision": {"p50_s": 0.001, "p99_s": 0.002}, "replay_s": 30.0,
            "cpu_s": {"engines": 45.0, "stores": 3.0, "router": None, "client": 1.5},
            "load_avg": [2.0, 6.5], "engines": {"steps": 1200, "preemptions": 3,
            "hook_ms_per_step": {"scheduler": 0.25, "worker": 1.5}}}  # fmt: skip
    trace = {
        "source": "x.jsonl", "requests": 3, "sessions": 2, "capped_requests": 0,
        "sampling": {"window_seconds": 40, "window_start_seconds": 3.0, "sample_ratio": 1.0,
                     "seed": 0},
        "scale": {"block_tokens": 16, "trace_block_tokens": 512, "length_scale": 1 / 32,
                  "max_prompt_tokens": 2000, "max_output_tokens": 16, "time_scale": 0.5},
        "prompt_tokens": {"mean": 500, "p90": 900}, "duration_s": 30, "arrival_rate_per_s": 0.1,
        "infinite_cache_hit_ratio": 0.3, "cross_session_hit_share": 0.5,
        "classes": [{"name": "WARM", "below_sent_tokens": 156}, {"name": "HEAVY",
                     "below_sent_tokens": None}],
    }  # fmt: skip
    topo = {"nodes": 2, "instances_per_node": 1, "kv_cache_bytes": 4 << 20, "pool": "256MiB"}
    return {"command": "kvtier bench cluster --quick", "trace": trace, "topology": topo,
            "kv_bytes_per_token": 1024, "configs": {"kvtier-kvtier": conf}}  # fmt: skip


def test_report_tables_and_figure(tmp_path: Path) -> None:
    report = _fake_report()
    md = cluster_report.markdown(report)
    assert "| kvtier + kvtier | 3 / 3 | 0 / 0 | 0.10 / 0.20 / 0.30 |" in md
    assert "30.0% / 10.0% / 0.0%" in md and "WARM < 156" in md
    assert "4096 tokens" in md
    # cores by role: 45 CPU s of engines in 30 s is 1.5 cores; a role not measured is left out
    assert "| configuration | replay s | engines | stores | client | all |" in md
    assert (
        "| kvtier + kvtier | 30 | 1.50 | 0.10 | 0.05 | 1.65 | 2.0, 6.5 | 1200 | 3 | 0.25 / 1.50 |"
        in md
    )
    assert "Hits and misses" not in md  # a report from before the split: no empty table
    report["configs"]["kvtier-kvtier"]["hit_split"] = {
        "hits": {"requests": 2, "ttft_s": {"p50": 0.05, "p90": 0.07}},
        "long_misses": {"requests": 5, "ttft_s": {"p50": 0.2, "p90": 0.4},
                        "ms_per_token": {"p50": 0.45, "p90": 0.6}},
    }  # fmt: skip
    md = cluster_report.markdown(report)
    assert "| kvtier + kvtier | 2: 0.05 / 0.07 | 5: 0.20 / 0.40 | 0.45 / 0.60 |" in md
    cluster_report.plot(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000
