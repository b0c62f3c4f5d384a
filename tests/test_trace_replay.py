"""``kvtier trace replay``: prompts that reproduce the trace's sharing, crash-safe results, and
an end-to-end replay against a real vLLM server (CPU build, tiny model) whose prefix cache
hits exactly where the trace says requests share a prefix."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from trace_helpers import req, shared_lines, write_trace
from trace_vllm_server import BLOCK_SIZE, SPECIAL_TOKENS, VOCAB_SIZE, VllmServer, build_tiny_model

from kvtier.core.errors import KvtierError
from kvtier.traces.prompts import PromptBuilder, PromptSpec, classify, parse_classes
from kvtier.traces.replay import (
    ReplayOptions,
    ReplayResult,
    ResultSink,
    TraceReplaySpec,
    read_results,
    replay_trace,
)
from kvtier.traces.summary import summarize

# -- prompts -------------------------------------------------------------------------------


def test_prompts_share_exactly_what_hash_ids_share() -> None:
    spec = PromptSpec(block_tokens=32, vocab_size=512, token_offset=4, seed=1)
    a = PromptBuilder(spec).tokens([7, 8, 9], 3 * 512 - 100)
    b = PromptBuilder(spec).tokens([7, 8, 10, 11], 4 * 512)  # a new builder: no shared cache
    assert len(a) == 90 and len(b) == 128  # ceil(1436 * 32 / 512): the last block partial
    assert a[:64] == b[:64]  # blocks 7, 8
    assert a[64:70] != b[64:70]
    assert min(a + b) >= 4 and max(a + b) < 512
    assert (
        PromptBuilder(PromptSpec(block_tokens=32, vocab_size=512, token_offset=4, seed=2)).tokens(
            [7], 32
        )
        != a[:32]
    )  # another seed, other tokens
    full = PromptBuilder(PromptSpec()).tokens([1 << 62, -5], 1000)
    assert len(full) == 1000  # unscaled: exactly input_length; any int hash id works


def test_prompt_length_stays_in_its_last_block() -> None:
    builder = PromptBuilder(PromptSpec(block_tokens=32))
    assert builder.prompt_length(1, 1) == 1
    assert builder.prompt_length(513, 2) == 33  # 513 * 32 / 512 rounds up, inside block 2
    assert builder.prompt_length(0, 0) == 0


def test_classes() -> None:
    classes = parse_classes("WARM:5000,MEDIUM:20000,HEAVY")
    assert [classify(classes, n) for n in (0, 4999, 5000, 20000, 10**6)] == [
        "WARM",
        "WARM",
        "MEDIUM",
        "HEAVY",
        "HEAVY",
    ]
    for bad in ("A:5,B:3,C", "A:x,B", "A,B", ""):
        with pytest.raises(KvtierError):
            parse_classes(bad)


# -- results and summaries ------------------------------------------------------------------


def _result(i: int, status: str = "ok", **kw: object) -> ReplayResult:
    base = dict(
        index=i,
        session="s",
        turn=1,
        cls="WARM",
        warmup=False,
        status=status,
        scheduled_s=0.0,
        ttft_s=0.1 * (i + 1),
        e2e_s=0.2 * (i + 1),
        prompt_tokens=100,
        output_tokens=3,
        tpot_s=0.01,
    )
    base.update(kw)
    return ReplayResult(**base)  # type: ignore[arg-type]


def test_sink_survives_a_torn_line_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    sink = ResultSink(path)
    for i in range(3):
        sink.write(_result(i))
    sink.close()
    with open(path, "a") as f:
        f.write('{"index": 3, "sess')  # a crash in the middle of a write
    resumed = ResultSink(path, resume=True)
    assert resumed.done == {0, 1, 2}
    resumed.write(_result(3))
    resumed.close()
    assert [r["index"] for r in read_results(path)] == [0, 1, 2, 3]
    fresh = ResultSink(path)  # without resume: a new file
    fresh.close()
    assert read_results(path) == []


def test_summary_counts_errors_and_excludes_warmup() -> None:
    results = [
        _result(0, warmup=True, ttft_s=100.0),
        *(_result(i) for i in range(1, 9)),
        _result(9, status="timeout", ttft_s=None, error="no complete response within 1 s"),
        _result(10, status="error", ttft_s=None, cls="HEAVY", error="HTTP 400: too long"),
    ]
    s = summarize(results, ["WARM", "MEDIUM", "HEAVY"])
    assert (s["recorded"], s["warmup"], s["requests"]) == (11, 1, 10)
    assert (s["ok"], s["errors"], s["timeouts"]) == (8, 1, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(
        np.percentile([0.1 * (i + 1) for i in range(1, 9)], 50)
    )
    assert s["classes"]["HEAVY"] == {**s["classes"]["HEAVY"], "requests": 1, "errors": 1, "ok": 0}
    assert s["classes"]["MEDIUM"]["requests"] == 0
    assert sum(s["error_kinds"].values()) == 2


def test_summarize_cli_reads_a_results_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvtier.cli import app

    path = tmp_path / "r.jsonl"
    sink = ResultSink(path)
    for i in range(4):
        sink.write(_result(i, cls="HEAVY" if i == 3 else "WARM"))
    sink.write(_result(4, status="error", ttft_s=None, error="HTTP 500: boom"))
    sink.close()
    out = tmp_path / "s.json"
    result = CliRunner().invoke(
        app, ["trace", "summarize", str(path), "--classes", "WARM,HEAVY", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert (summary["ok"], summary["errors"]) == (4, 1)
    assert list(summary["classes"]) == ["WARM", "HEAVY"]
    assert summary["classes"]["WARM"]["errors"] == 1
    missing = CliRunner().invoke(app, ["trace", "summarize", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2


def test_unreachable_server_errors_are_recorded(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [req(0, [1]), req(1, [1, 2])])
    sink = ResultSink(tmp_path / "r.jsonl")
    opts = ReplayOptions(url="http://127.0.0.1:9", model="m", timeout_s=5)
    try:
        results = asyncio.run(replay_trace(trace, opts, TraceReplaySpec(time_scale=0.01), sink))
    finally:
        sink.close()
    assert [r.status for r in results] == ["error", "error"]
    assert all("Connect" in (r.error or "") for r in results)
    assert len(read_results(tmp_path / "r.jsonl")) == 2


# -- end to end against vLLM ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    root = tmp_path_factory.mktemp("vllm")
    server = VllmServer(build_tiny_model(root / "tiny"), root / "vllm.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _sharing_subset(max_blocks: int, hits_wanted: int) -> list[dict]:
    """Shared-trace requests small enough for the tiny model: the first ``hits_wanted`` that
    share a prefix with an earlier one (among the small ones), the requests they share it with,
    and the non-sharing ones in between, in trace order."""
    small = [line for line in shared_lines() if len(line["hash_ids"]) <= max_blocks]
    seen: dict[int, int] = {}  # hash id -> latest request using it
    chosen: set[int] = set()
    hits = 0
    for i, line in enumerate(small):
        k = 0
        for h in line["hash_ids"]:
            if h not in seen:
                break
            k += 1
        if k:
            chosen |= {i, seen[line["hash_ids"][k - 1]]}
            hits += 1
        elif len(chosen) < 3 * hits_wanted:
            chosen.add(i)
        for h in line["hash_ids"]:
            seen[h] = i
        if hits == hits_wanted:
            break
    return [small[i] for i in sorted(chosen)]


def _replay_cli(trace: Path, server: VllmServer, out: Path, *args: str) -> dict:
    summary = out.with_suffix(".summary.json")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "trace",
            "replay",
            str(trace),
            "--url",
            server.url,
            "--model",
            server.model,
            "--out",
            str(out),
            "--json",
            str(summary),
            "--block-tokens",
            str(BLOCK_SIZE),
            "--vocab-size",
            str(VOCAB_SIZE),
            "--token-offset",
            str(SPECIAL_TOKENS),
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(summary.read_text())


def _vllm_cached(expected: int, prompt_tokens: int) -> int:
    # vLLM never serves a whole prompt from cache: it recomputes at least the last token.
    return min(expected, (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)


@pytest.mark.vllm
def test_replay_reproduces_the_traces_prefix_hits(tmp_path: Path, vllm_server: VllmServer) -> None:
    lines = _sharing_subset(max_blocks=30, hits_wanted=12)
    too_long = req(lines[-1]["timestamp"] + 1, list(range(10**6, 10**6 + 80)))  # 2560 tokens
    trace = write_trace(tmp_path / "t.jsonl", [*lines, too_long])
    before = vllm_server.metrics()
    summary = _replay_cli(
        trace,
        vllm_server,
        tmp_path / "r.jsonl",
        "--concurrency",
        "1",
        "--max-output-tokens",
        "4",
        "--seed",
        "11",
    )
    after = vllm_server.metrics()
    results = read_results(tmp_path / "r.jsonl")
    assert [r["index"] for r in results] == list(range(len(lines) + 1))

    # Independently of the tool: which requests share a prefix with an earlier one.
    seen: set[int] = set()
    sharing = 0
    for line, r in zip(lines, results, strict=False):
        k = 0
        for h in line["hash_ids"]:
            if h not in seen:
                break
            k += 1
        seen.update(line["hash_ids"])
        assert r["status"] == "ok", r
        assert r["output_tokens"] == min(4, max(line["output_length"], 1))
        assert r["expected_cached_tokens"] == min(k * BLOCK_SIZE, r["prompt_tokens"])
        # The server's prefix cache hits exactly the shared blocks, and nothing else.
        assert r["cached_tokens"] == _vllm_cached(k * BLOCK_SIZE, r["prompt_tokens"]), r
        sharing += k > 0
    assert sharing == 12

    error = results[-1]
    assert (error["status"], error["http_status"]) == ("error", 400)
    assert "maximum context length" in error["error"]
    assert (summary["ok"], summary["errors"], summary["timeouts"]) == (len(lines), 1, 0)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits == sum(r["cached_tokens"] for r in results if r["status"] == "ok") > 0
    assert summary["server_metrics"]["vllm:prefix_cache_hits_total"] == hits
    assert summary["ttft_s"]["p50"] > 0 and summary["e2e_s"]["p99"] >= summary["e2e_s"]["p50"]


def _sessions_trace(path: Path, sessions: int, turns: int, gap_ms: int) -> Path:
    lines = []
    for t in range(1, turns + 1):
        for s in range(sessions):
            hashes = [s * 1000 + b for b in range(3 * t)]  # each turn adds three blocks
            lines.append(req((t * sessions + s) * gap_ms, hashes, out=3, session=f"s{s}", turn=t))
    return write_trace(path, lines)


@pytest.mark.vllm
def test_closed_loop_keeps_turn_order(tmp_path: Path, vllm_server: VllmServer) -> None:
    trace = _sessions_trace(tmp_path / "s.jsonl", sessions=3, turns=3, gap_ms=0)
    summary = _replay_cli(
        trace,
        vllm_server,
        tmp_path / "r.jsonl",
        "--concurrency",
        "3",
        "--seed",
        "12",
        "--warmup",
        "3",
    )
    results = read_results(tmp_path / "r.jsonl")
    by_session: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["turn"]):
        by_session.setdefault(r["session"], []).append(r)
    assert sorted(by_session) == ["s0", "s1", "s2"]
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            assert nxt["sent_s"] >= prev["sent_s"] + prev["e2e_s"]  # waited for its turn
            # the previous turn's full blocks are cached when the next one starts
            assert (
                nxt["cached_tokens"]
                == _vllm_cached(nxt["expected_cached_tokens"], nxt["prompt_tokens"])
                > 0
            )
    assert (summary["recorded"], summary["warmup"], summary["ok"]) == (9, 3, 6)


@pytest.mark.vllm
def test_open_loop_timing_timeouts_and_resume(tmp_path: Path, vllm_server: VllmServer) -> None:
    trace = _sessions_trace(tmp_path / "s.jsonl", sessions=2, turns=3, gap_ms=1000)
    out = tmp_path / "r.jsonl"
    # Trace times x0.2: requests go out every 0.2 s, whatever is in flight.
    _replay_cli(trace, vllm_server, out, "--time-scale", "0.2", "--seed", "13", "--limit", "4")
    first = read_results(out)
    assert [r["index"] for r in sorted(first, key=lambda r: r["index"])] == [0, 1, 2, 3]
    for r in first:
        assert r["scheduled_s"] == pytest.approx(r["index"] * 0.2)
        assert r["sent_s"] >= r["scheduled_s"] and r["lag_s"] < 0.5
    # Resume: the first four are kept as they were, the rest are sent.
    summary = _replay_cli(
        trace, vllm_server, out, "--time-scale", "0.2", "--seed", "13", "--resume"
    )
    results = read_results(out)
    assert results[:4] == first
    assert sorted(r["index"] for r in results) == list(range(6))
    assert summary["recorded"] == 6 and summary["ok"] == 6
    # A timeout shorter than the generation: counted as timeouts, not dropped.
    slow = write_trace(tmp_path / "slow.jsonl", [req(0, [77, 78], out=400), req(1, [79], out=400)])
    summary = _replay_cli(
        slow, vllm_server, tmp_path / "t.jsonl", "--timeout", "0.3", "--seed", "14"
    )
    assert (summary["requests"], summary["timeouts"], summary["ok"]) == (2, 2, 0)
    timed_out = read_results(tmp_path / "t.jsonl")
    assert all(r["status"] == "timeout" and r["e2e_s"] >= 0.3 for r in timed_out)
