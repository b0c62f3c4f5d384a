"""``kvtier bench cluster --quick`` on real processes: vLLM CPU instances, node stores and the
router answer every request of the sampled trace, with prefix hits in the tiers expected
(the plan, report and figures without vLLM: tests/unit/bench/test_cluster.py).

Budget: 2 vLLM servers per configuration, 3 configurations, ~3 minutes on 2 cores (172 s
measured).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.cluster import run as cluster
from kvtier.testing.models import ModelInfo, make_model

MOONCAKE = Path("/work/shared/data/traces/mooncake_synthetic_trace.jsonl")


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared trace is not here")
def test_quick_run_answers_everything_with_the_tiers_where_expected(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny", "tiny")
    settings = cluster.ClusterSettings(
        model_dir=model,
        out_dir=tmp_path / "out",
        trace=cluster.make_plan(quick=True),
        topology=cluster.make_topology(
            quick=True, kv_bytes_per_token=ModelInfo.read(model).kv_bytes_per_token
        ),
        timeout_s=120,
    )
    # vLLM alone and kvtier + kvtier: what differs between configurations (connector, stores,
    # the kvtier policy) is all here; `--quick`'s third (vLLM + lmetric) is one more vLLM-only
    # run through the same code (its policy is tested in tests/unit/router/test_policies.py), and
    # 70 s of the suite's 30-minute budget
    configs = ["vllm-rr", "kvtier-kvtier"]
    assert set(configs) <= set(cluster.QUICK_CONFIGS)
    report = cluster.run(settings, configs, say=lambda _: None, progress=False)
    assert report["failed"] == {}
    sent = report["trace"]["requests"]
    assert sent >= 30
    for name, r in report["configs"].items():
        assert (r["requests"], r["ok"], r["errors"], r["timeouts"]) == (sent, sent, 0, 0), name
        tokens = r["tiers"]["tokens"]
        assert tokens["device"] > 0, f"{name}: no GPU prefix hit"
        if cluster.CONFIGS[name].kvtier:
            # Which DRAM (this node's or the other's) depends on where the router sent a
            # returning turn under the run's load; the demo test pins each tier exactly.
            assert tokens["host"] + tokens["p2p"] > 0, f"{name}: no DRAM hit, local or remote"
        else:
            assert tokens["host"] == tokens["p2p"] == 0, name
        assert r["router_decision"]["count"] == sent, name
        assert r["cpu_s"]["engines"] > 0 and r["cpu_s"]["router"] > 0, name  # they served it
        assert ("stores" in r["cpu_s"]) == cluster.CONFIGS[name].kvtier, name
        hook_s = r["engines"]["hook_seconds"]
        assert r["engines"]["steps"] > 0, name
        # kvtier's connector reports the time the engines spent in its hooks; nothing else does
        assert (hook_s["scheduler"] > 0 and hook_s["worker"] > 0) == cluster.CONFIGS[name].kvtier
        lines = (tmp_path / "out" / name / "requests.jsonl").read_text().splitlines()
        served = [json.loads(line)["meta"]["instance"] for line in lines]
        assert set(served) <= set(r["instances"]) and "" not in served, name
    rr = report["configs"]["vllm-rr"]["instances"]
    assert all(f["requests"] > 0 for f in rr.values())  # round-robin used every instance
    assert (tmp_path / "out" / "cluster.json").exists()
