"""``kvtier trace replay``: prompts that reproduce the trace's sharing, crash-safe results and
their summaries (the end-to-end replay against a real vLLM server:
tests/engine/test_trace_replay.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

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

from support.trace_helpers import req, write_trace

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
