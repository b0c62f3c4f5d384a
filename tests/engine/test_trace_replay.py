"""``kvtier trace replay`` end to end against a real vLLM server (CPU build, tiny model): its
prefix cache hits exactly where the trace says requests share a prefix; closed-loop sessions
keep their turn order; open-loop timing, timeouts and resume (prompts, results and summaries
without vLLM: tests/unit/traces/test_replay.py)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.traces.replay import read_results

from support.trace_helpers import req, shared_lines, write_trace
from support.trace_vllm_server import (
    BLOCK_SIZE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    VllmServer,
    build_tiny_model,
)


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
