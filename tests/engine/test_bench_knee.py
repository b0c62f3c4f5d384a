"""``kvtier bench knee`` end to end on vLLM CPU instances: prefix hits collapse below the
working set and a DRAM tier gives them back (the workload, capacities and report without
vLLM: tests/unit/bench/test_knee.py).

Budget: three vLLM servers (~30-45 s each on 2 cores), ~2 minutes in all.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

from kvtier.bench.knee import run as knee
from kvtier.bench.knee.workload import Workload
from kvtier.testing.models import ModelInfo, make_model


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_hits_collapse_below_the_working_set_and_dram_gives_them_back(tmp_path: Path) -> None:
    from kvtier.bench.knee import report as knee_report

    model_dir = make_model(tmp_path / "tiny", "tiny")
    info = ModelInfo.read(model_dir)
    w = Workload(sessions=4, turns=4, user_tokens=96, output_tokens=32)  # S*W = 64 blocks
    below, above = knee.gpu_blocks_for([0.5, 1.5], w)
    dram = knee.dram_bytes_for("2", w, info.kv_bytes_per_token)
    configs = [knee.KneeConfig(None, below), knee.KneeConfig(None, above)]
    configs.append(knee.KneeConfig(dram, below))
    settings = knee.RunSettings(model_dir, info, tmp_path / "out")
    segments_before = _pool_segments()
    report = knee.run(w, configs, settings, preset="tiny", progress=False)
    low, high, tiered = report.results

    ideal = w.ideal_hit_ratio
    for r in report.results:
        assert r.errors == 0 and r.requests == 16
        # the server counted exactly the workload's prompts: the warm-up is not in the deltas
        assert r.queried_tokens == r.client_prompt_tokens == w.prompt_tokens
        per_request = [json.loads(line) for line in Path(r.results).read_text().splitlines()]
        measured = [x for x in per_request if not x["warmup"]]
        assert sum(x["cached_tokens"] for x in measured) == sum(r.cached_tokens.values())
        assert r.hit["total"] <= ideal + 1e-9  # nothing hits that an infinite cache would not
        _check_closed_loop(measured)
    # above S*W every reusable prefix hits on the GPU; below it, sessions evict each other
    assert high.hit["device"] == pytest.approx(ideal)
    assert low.hit["device"] < 0.75 * high.hit["device"]
    assert low.hit["host"] == high.hit["host"] == 0
    # with a DRAM tier the evicted prefixes come back from DRAM (host), almost all of them
    assert tiered.hit["host"] > 0.1 * ideal
    assert tiered.hit["total"] >= 0.9 * ideal
    assert tiered.kvtier["cpu_hit_tokens"] == tiered.cached_tokens["host"]
    assert tiered.dram_multiple == pytest.approx(2.0)

    knees = {(k["dram_bytes"], k["tier"]): k for k in report.knees()}
    assert knees[(None, "total")]["gpu_blocks"] == above
    assert knees[(dram, "total")]["gpu_blocks"] == below  # DRAM moves the knee down

    out = settings.out_dir
    knee_report.print_report(report)
    knee_report.plot(report, out / "knee.png")
    assert (out / "knee.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(json.dumps(report.to_json()))
    assert data["workload"]["total_working_set_tokens"] == 4 * 512
    assert len(data["configs"]) == 3 and data["machine"]["vllm_build"] == "CPU"
    assert (out / "workload.jsonl").exists()
    assert not list(out.glob("*.run"))  # the embedded store's run dir and pool are gone
    # vLLM's shutdown SIGKILLs its engine's whole process tree; the embedded store's watchdog
    # is outside it and unlinks the pool segment (1 GiB each was left before it was).
    deadline = time.monotonic() + 10
    while _pool_segments() - segments_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pool_segments() - segments_before


def _pool_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvtier-")}


def _check_closed_loop(records: list[dict]) -> None:
    """Each session sends a turn only after its previous turn finished; sessions overlap."""
    sessions: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        sessions[r["session"]].append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, nxt in itertools.pairwise(turns):
            assert nxt["sent_s"] >= prev["sent_s"] + prev["e2e_s"] - 1e-6
    first = [turns[0] for turns in sessions.values()]
    assert max(r["sent_s"] for r in first) < min(r["sent_s"] + r["e2e_s"] for r in first)
