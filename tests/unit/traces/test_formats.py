"""Trace readers and writers: both formats, validation with file:line errors, gzip."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.formats import (
    TraceFormat,
    TraceReader,
    TraceRequest,
    TraceWriter,
    read_trace,
)

from support.trace_helpers import SHARED_TRACE, req, write_trace


def test_reads_the_shared_trace_as_mooncake() -> None:
    reader = TraceReader(SHARED_TRACE)
    assert reader.format is TraceFormat.MOONCAKE
    first = next(iter(reader))
    assert first == TraceRequest(
        timestamp=0, input_length=40160, output_length=6, hash_ids=list(range(79))
    )
    assert first.session_id is None and first.turn is None


def test_session_format_round_trip_and_gzip(tmp_path: Path) -> None:
    lines = [
        req(0, [1, 2], session="a", turn=1),
        req(5, [1, 2, 3], session="a", turn=2),
        req(7, [9], session="b", turn=1),
    ]
    src = write_trace(tmp_path / "s.jsonl", lines)
    assert TraceReader(src).format is TraceFormat.SESSION
    reqs = list(read_trace(src))
    assert [(r.session_id, r.turn) for r in reqs] == [("a", 1), ("a", 2), ("b", 1)]
    out = tmp_path / "copy.jsonl.gz"
    with TraceWriter(out, TraceFormat.SESSION) as w:
        for r in reqs:
            w.write(r)
    with gzip.open(out, "rt") as f:
        assert [json.loads(line) for line in f] == lines
    assert list(read_trace(out)) == reqs
    # Mooncake output drops the session fields and stays readable as Mooncake.
    moon = tmp_path / "m.jsonl"
    with TraceWriter(moon, TraceFormat.MOONCAKE) as w:
        for r in reqs:
            w.write(r)
    assert "session_id" not in moon.read_text()
    assert [r.hash_ids for r in read_trace(moon)] == [r.hash_ids for r in reqs]


@pytest.mark.parametrize(
    ("line", "fmt", "why"),
    [
        ("{not json", "auto", "2: "),
        (json.dumps(req(9, [1, 2], input_length=2000)), "auto", "expected ceil(2000/512) = 4"),
        (json.dumps(req(-1, [1])), "auto", "negative"),
        (json.dumps(req(0, [1])), "auto", "sort the trace by time"),
        (json.dumps({"timestamp": 9, "input_length": 5}), "auto", "missing required field"),
        (json.dumps(req(9, [1], session="x", turn=1)), "session", "session format needs"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, fmt: str, why: str) -> None:
    first = req(5, [1], session="x", turn=1) if fmt == "session" else req(5, [1])
    if fmt == "session" and "session format needs" in why:
        line = json.dumps(req(9, [1]))  # a session trace line without its session
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(first) + "\n" + line + "\n")
    with pytest.raises(KvtierError) as err:
        list(read_trace(path, fmt))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert f"{path}:2" in str(err.value)
    assert why in str(err.value)


def test_session_turns_must_increase(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [req(0, [1], session="a", turn=2), req(1, [1, 2], session="a", turn=2)],
    )
    with pytest.raises(KvtierError, match="turn 2 after turn 2"):
        list(read_trace(path))


def test_block_tokens_option(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "b.jsonl", [req(0, [1, 2, 3], input_length=70)])
    with pytest.raises(KvtierError, match="is --block-tokens right"):
        list(read_trace(path))
    assert len(next(read_trace(path, block_tokens=32)).hash_ids) == 3


def test_missing_file() -> None:
    with pytest.raises(KvtierError, match="does not exist"):
        TraceReader("/nonexistent/trace.jsonl")
