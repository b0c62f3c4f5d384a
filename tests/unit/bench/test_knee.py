"""``kvtier bench knee``: the multi-turn workload (cumulative prefixes, deterministic tokens,
lengths), capacities, the knee and its report, in well under a second. The end-to-end sweep
against real vLLM servers: tests/engine/test_bench_knee.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from kvtier.bench.knee import run as knee
from kvtier.bench.knee.results import ConfigResult, KneeReport, find_knee
from kvtier.bench.knee.workload import Workload
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.analyze import analyze_file
from kvtier.traces.formats import TraceReader
from kvtier.traces.replay import Replayer, ReplayOptions
from kvtier.traces.server_metrics import parse_prometheus

W = Workload(sessions=3, turns=4, user_tokens=64, output_tokens=32, seed=7)


def _prompts(w: Workload) -> dict[tuple[str, int], list[int]]:
    return {(i.session, i.turn): i.make_tokens() for i in w.items()}


# -- the workload ---------------------------------------------------------------------------


def test_turns_extend_the_previous_prompt_by_an_answer_and_a_user_message() -> None:
    prompts = _prompts(W)
    assert len(prompts) == 3 * 4
    for s in range(3):
        previous: list[int] = []
        for t in range(1, 5):
            prompt = prompts[(f"s{s}", t)]
            assert len(prompt) == t * 64 + (t - 1) * 32 == W.prompt_length(t)
            assert prompt[: len(previous)] == previous  # cumulative prefix
            new = prompt[len(previous) :]
            assert len(new) == (64 if t == 1 else 32 + 64)  # the stand-in answer + U
            assert new[:32] != previous[-32:]  # new tokens, not a repeat
            previous = prompt
        assert W.working_set_tokens == len(previous) + 32  # the last prompt and its answer
    # sessions share nothing: not even their first block
    firsts = {tuple(prompts[(f"s{s}", 1)][:32]) for s in range(3)}
    assert len(firsts) == 3
    everything = np.concatenate([np.array(p) for p in prompts.values()])
    assert everything.min() >= W.token_offset and everything.max() < W.vocab_size


def test_tokens_are_a_function_of_seed_session_and_turn() -> None:
    items = W.items()
    backwards = {(i.session, i.turn): i.make_tokens() for i in reversed(items)}
    assert backwards == _prompts(W)  # no dependence on the order prompts are built in
    assert _prompts(Workload(**{**W.__dict__})) == backwards  # a fresh generator agrees
    other = _prompts(Workload(**{**W.__dict__, "seed": 8}))
    assert other[("s0", 1)] != backwards[("s0", 1)]
    more = _prompts(Workload(**{**W.__dict__, "sessions": 5, "turns": 6}))
    assert all(more[key] == tokens for key, tokens in backwards.items())  # a bigger run extends


def test_items_carry_sessions_turns_and_ideal_hits() -> None:
    items = W.items()
    assert [i.index for i in items] == list(range(12))
    assert [(i.session, i.turn) for i in items[:4]] == [("s0", 1), ("s1", 1), ("s2", 1), ("s0", 2)]
    for i in items:
        assert i.max_tokens == 32 and not i.warmup
        assert i.expected_cached_tokens == (0 if i.turn == 1 else W.prompt_length(i.turn - 1))
    lengths = [W.prompt_length(t) for t in range(1, 5)]
    assert W.prompt_tokens == 3 * sum(lengths)
    assert W.ideal_hit_ratio == pytest.approx(sum(lengths[:-1]) / sum(lengths))
    assert W.total_working_set_tokens == 3 * (lengths[-1] + 32) == W.max_model_len * 3


def test_warmup_shares_no_block_with_the_workload() -> None:
    warm = W.warmup_items()
    assert [i.warmup for i in warm] == [True, True] and warm[0].session == warm[1].session
    tokens = warm[0].make_tokens()
    assert tokens == warm[1].make_tokens() and len(tokens) == W.prompt_length(2)
    blocks = {tuple(p[k : k + 32]) for p in _prompts(W).values() for k in range(0, len(p), 32)}
    assert not any(tuple(tokens[k : k + 32]) in blocks for k in range(0, len(tokens), 32))


def test_the_workload_is_a_session_trace_the_trace_tools_read(tmp_path: Path) -> None:
    path = W.write_trace(tmp_path / "w.jsonl")
    requests = list(TraceReader(path, block_tokens=32))
    assert [(r.session_id, r.turn, r.input_length) for r in requests[:4]] == [
        ("s0", 1, 64),
        ("s1", 1, 64),
        ("s2", 1, 64),
        ("s0", 2, 160),
    ]
    report = analyze_file(path, block_tokens=32)
    assert report["sessions"]["count"] == 3
    assert report["infinite_cache"]["hit_ratio_tokens"] == pytest.approx(W.ideal_hit_ratio)
    assert report["sessions"]["intra_session_hit_share"] == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"user_tokens": 50},  # not whole blocks
        {"output_tokens": 16},
        {"sessions": 0},
        {"turns": 0},
        {"vocab_size": 4},  # no ordinary token left
    ],
)
def test_bad_workloads_are_refused(kwargs: dict) -> None:
    with pytest.raises(KvtierError) as e:
        Workload(**kwargs)
    assert e.value.code is ErrorCode.INVALID_ARGUMENT


# -- capacities and the knee ----------------------------------------------------------------


def test_capacities() -> None:
    w = Workload()  # S*W = 4 * 1536 tokens = 192 blocks
    assert w.total_working_set_tokens == 6144
    assert knee.gpu_blocks_for([0.25, 0.5, 1, 2], w) == [48, 96, 192, 384]
    assert knee.dram_bytes_for("none", w, 1024) is None
    assert knee.dram_bytes_for(" 2 ", w, 1024) == 2 * 6144 * 1024
    assert knee.dram_bytes_for("64MiB", w, 1024) == 64 << 20
    for bad in ("0", "-1", "lots"):
        with pytest.raises(KvtierError):
            knee.dram_bytes_for(bad, w, 1024)
    configs = knee.grid([96, 48, 96], [8 << 20, None])
    assert [(c.dram_bytes, c.gpu_blocks) for c in configs] == [
        (None, 48),
        (None, 96),
        (8 << 20, 48),
        (8 << 20, 96),
    ]
    knee.check_configs(configs, w)
    with pytest.raises(KvtierError, match=r"smallest capacity is 0.25 x S\*W"):
        knee.check_configs([knee.KneeConfig(None, 47)], w)


def test_find_knee() -> None:
    points = [(48, 0.07), (96, 0.36), (144, 0.80), (192, 0.81), (384, 0.73)]
    assert find_knee(points, 0.9) == (144, 0.81)
    assert find_knee(points, 0.4) == (96, 0.81)
    assert find_knee([(1, 0.0), (2, 0.0)], 0.9) is None
    assert find_knee([], 0.9) is None


def _result(gpu_blocks: int, dram: int | None, device: float, host: float) -> ConfigResult:
    tokens = gpu_blocks * 32
    return ConfigResult(
        gpu_blocks=gpu_blocks,
        gpu_tokens=tokens,
        gpu_multiple=tokens / 6144,
        dram_bytes=dram,
        dram_multiple=None if dram is None else dram / (6144 * 1024),
        requests=24,
        errors=0,
        queried_tokens=1000.0,
        client_prompt_tokens=1000,
        cached_tokens={"device": 1000 * device, "host": 1000 * host, "p2p": 0.0},
        hit={"device": device, "host": host, "p2p": 0.0, "total": device + host},
        ttft_p50_s=0.1 / (device + host + 0.01),
        ttft_p90_s=0.2 / (device + host + 0.01),
        ttft_by_turn_p50_s={"turn 1": 0.1},
        preemptions=0.0,
        kvtier={},
        load_avg=(1.0, 1.0, 1.0),
        wall_s=30.0,
        results="r.jsonl",
        log="vllm.log",
    )


def test_report_knees_table_plot_and_json_round_trip(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvtier.bench.knee import report as knee_report
    from kvtier.cli import app

    dram = 12 << 20
    line = [(48, 0.05), (96, 0.22), (144, 0.54), (192, 0.71), (384, 0.71)]
    results = [_result(b, None, h, 0.0) for b, h in line]
    results += [_result(b, dram, h, 0.71 - h) for b, h in reversed(line)]  # any order
    w = {**Workload().describe(), "total_working_set_bytes": 6144 * 1024, "chunk_tokens": 32}
    machine = {"vllm": "0.32.0", "vllm_build": "CPU"}
    report = KneeReport(machine, {"preset": "tiny", "path": "m"}, w, 0.9, results)
    assert list(report.lines()) == [None, dram]
    assert [r.gpu_blocks for r in report.lines()[dram]] == [48, 96, 144, 192, 384]
    knees = {(k["dram_bytes"], k["tier"]): k for k in report.knees()}
    assert set(knees) == {(None, "total"), (dram, "total"), (dram, "device")}
    assert knees[(None, "total")]["gpu_blocks"] == 192
    assert knees[(None, "total")]["gpu_multiple"] == 1.0
    assert knees[(dram, "device")]["gpu_blocks"] == 192
    assert knees[(dram, "total")]["gpu_blocks"] == 48
    assert knees[(dram, "total")]["at_or_below_smallest"]
    lines = knee_report.knee_lines(report)
    assert any("1.00 x S*W" in x for x in lines) and any("there or below" in x for x in lines)

    path = tmp_path / "knee.json"
    path.write_text(json.dumps(report.to_json()))
    again = KneeReport.from_json(json.loads(path.read_text()))
    assert again.knees() == report.knees()
    result = CliRunner().invoke(app, ["bench", "knee", "--report", str(path)])
    assert result.exit_code == 0, result.output
    assert "capacity knee" in result.output and "knee, DRAM none" in result.output
    assert (tmp_path / "knee.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prometheus_labels_kept_or_summed() -> None:
    cached = "vllm:prompt_tokens_cached_by_source_total"
    text = "\n".join(
        [
            "# TYPE vllm:prompt_tokens_cached_by_source counter",
            cached + '{engine="0",model_name="m",source="device"} 96.0',
            cached + '{engine="1",model_name="m",source="device"} 4.0',
            cached + '{engine="0",model_name="a \\"b\\", c",source="host"} 32.0',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 500.0',
        ]
    )
    kept = parse_prometheus(text, ("source",))
    assert kept == {
        "vllm:prompt_tokens_cached_by_source_total{source=device}": 100.0,
        "vllm:prompt_tokens_cached_by_source_total{source=host}": 32.0,
        "vllm:prefix_cache_queries_total": 500.0,
    }
    assert parse_prometheus(text)["vllm:prompt_tokens_cached_by_source_total"] == 132.0


def test_per_session_pacing_keeps_each_sessions_turns_in_order() -> None:
    items = W.items()
    for item in items[::4]:
        item.session = ""  # these become sessions of their own
    opts = ReplayOptions(url="http://127.0.0.1:9", model="m", timeout_s=5, per_session=True)
    results = asyncio.run(Replayer(opts).run(items))
    assert sorted(r.index for r in results) == list(range(12))
    assert all(r.status == "error" and "Connect" in (r.error or "") for r in results)
    by_session: dict[str, list[int]] = defaultdict(list)
    for r in results:
        by_session[r.session or f"#{r.index}"].append(r.turn)
    assert len(by_session) == 3 + 3  # three named sessions, three loose items
    assert all(turns == sorted(turns) for turns in by_session.values())


def test_trace_replay_cli_sends_the_workload_per_session(tmp_path: Path) -> None:
    """The workload file replays with `kvtier trace replay --per-session` (any endpoint)."""
    from typer.testing import CliRunner

    from kvtier.cli import app
    from kvtier.traces.replay import read_results

    trace = W.write_trace(tmp_path / "w.jsonl")
    out = tmp_path / "r.jsonl"
    args = ["trace", "replay", str(trace), "--url", "http://127.0.0.1:9", "--model", "m"]
    args += ["--out", str(out), "--block-tokens", "32", "--trace-block-tokens", "32"]
    args += ["--vocab-size", "512", "--token-offset", "4", "--per-session", "--concurrency", "2"]
    result = CliRunner().invoke(app, [*args, "--no-metrics", "--timeout", "5"])
    assert result.exit_code == 0, result.output
    records = read_results(out)
    assert len(records) == 12 and all(r["status"] == "error" for r in records)
    turns: dict[str, list[int]] = defaultdict(list)
    for r in records:
        turns[r["session"]].append(r["turn"])
    assert turns == {f"s{s}": [1, 2, 3, 4] for s in range(3)}
    assert [r["prompt_tokens"] for r in records if r["session"] == "s0"] == [
        W.prompt_length(t) for t in range(1, 5)
    ]
