"""``kvtier trace sample``: whole sessions, the window, thinning by prefix group, the
single-turn cap, determinism, and a report that matches the written sample."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.core.errors import KvtierError
from kvtier.traces.analyze import analyze_file
from kvtier.traces.formats import TraceRequest, read_trace
from kvtier.traces.sample import MIN_THINNED_GROUP, SampleOptions, sample_file
from kvtier.traces.sessions import SessionTracker

from support.trace_helpers import SHARED_TRACE, req, write_trace


def _derived_sessions() -> dict[str, list[TraceRequest]]:
    tracker = SessionTracker.standalone(512, derive=True)
    out: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in read_trace(SHARED_TRACE):
        out[f"d{tracker.observe(r).session}"].append(r)
    return out


@pytest.fixture(scope="module")
def sessions() -> dict[str, list[TraceRequest]]:
    return _derived_sessions()


def _sample(tmp_path: Path, opts: SampleOptions, name: str = "s.jsonl") -> tuple[dict, list]:
    out = tmp_path / name
    report = sample_file(SHARED_TRACE, out, opts)
    return report, list(read_trace(out))


def test_window_thinning_and_cap(tmp_path: Path, sessions: dict) -> None:
    opts = SampleOptions(window_seconds=600, sample_ratio=0.5, max_single_turn_ratio=0.6, seed=1)
    report, reqs = _sample(tmp_path, opts)
    start_ms = report["options"]["window_start_seconds"] * 1000
    by_session: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session_id is not None
        by_session[r.session_id].append(r)
    for sid, turns in by_session.items():
        original = sessions[sid]
        # whole sessions, in order, with their turns, timing shifted to the window start
        assert [t.turn for t in turns] == list(range(1, len(original) + 1))
        assert [t.hash_ids for t in turns] == [o.hash_ids for o in original]
        assert [t.timestamp for t in turns] == [o.timestamp - start_ms for o in original]
        assert 0 <= turns[0].timestamp < 600_000
    single = sum(len(t) == 1 for t in by_session.values())
    assert single / len(by_session) <= 0.6
    assert report["written_requests"] == len(reqs)
    figs = report["figures"]
    assert figs["sample"]["sessions"] == len(by_session)
    assert figs["window"]["sessions"] > figs["sample"]["sessions"]
    # The report's sample figures are the written file's.
    again = analyze_file(tmp_path / "s.jsonl")
    assert again["infinite_cache"]["hit_ratio_blocks"] == pytest.approx(
        figs["sample"]["hit_ratio_blocks"]
    )


def test_small_prefix_groups_are_kept_or_dropped_whole(tmp_path: Path, sessions: dict) -> None:
    ratio = 0.3
    report, reqs = _sample(tmp_path, SampleOptions(sample_ratio=ratio, seed=3))
    root_of = {sid: (turns[0].hash_ids or [None])[0] for sid, turns in sessions.items()}
    group_size = Counter(root_of.values())
    kept = Counter(root_of[r.session_id] for r in reqs if r.turn == 1)
    for root, n in kept.items():
        if group_size[root] * ratio < MIN_THINNED_GROUP:
            assert n == group_size[root], root
        else:
            assert n == round(group_size[root] * ratio)
    figs = report["figures"]
    assert 0.2 < figs["sample"]["sessions"] / figs["trace"]["sessions"] < 0.4
    # Cross-session sharing survives thinning (per-session thinning would cut it).
    assert (
        figs["sample"]["cross_session_hit_share"] > 0.8 * figs["trace"]["cross_session_hit_share"]
    )


def test_large_groups_are_thinned_inside(tmp_path: Path) -> None:
    lines = []
    for s in range(40):  # 40 sessions behind one system prompt (blocks 1, 2)
        lines.append(req(s, [1, 2, 1000 + s], session=f"big{s}", turn=1))
    for s in range(6):  # three pairs sharing a document each
        lines.append(req(100 + s, [50 + s // 2, 500 + s], session=f"pair{s}", turn=1))
    src = write_trace(tmp_path / "g.jsonl", lines)
    out = tmp_path / "g_out.jsonl"
    report = sample_file(src, out, SampleOptions(sample_ratio=0.5, seed=4))
    kept = [r.session_id or "" for r in read_trace(out)]
    assert sum(k.startswith("big") for k in kept) == 20
    pairs = Counter(int(k[4:]) // 2 for k in kept if k.startswith("pair"))
    assert set(pairs.values()) <= {2}  # a pair is kept whole or not at all
    assert report["figures"]["sample"]["cross_session_hit_share"] == 1.0


def test_seeded_and_deterministic(tmp_path: Path) -> None:
    opts = SampleOptions(window_seconds=300, sample_ratio=0.4, seed=7)
    _, a = _sample(tmp_path, opts, "a.jsonl")
    _, b = _sample(tmp_path, opts, "b.jsonl")
    _, c = _sample(tmp_path, SampleOptions(window_seconds=300, sample_ratio=0.4, seed=8), "c.jsonl")
    assert a == b
    assert a != c


def test_session_trace_keeps_names_and_cap_zero(tmp_path: Path) -> None:
    lines = [
        req(0, [1], session="solo", turn=1),
        req(1, [5, 6], session="chat", turn=1),
        req(2, [5, 6, 7], session="chat", turn=2),
        req(3, [9], session="solo2", turn=1),
    ]
    src = write_trace(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    sample_file(src, out, SampleOptions(max_single_turn_ratio=0.0))
    assert [(r.session_id, r.turn) for r in read_trace(out)] == [("chat", 1), ("chat", 2)]


def test_bad_options() -> None:
    with pytest.raises(KvtierError, match="sample ratio"):
        SampleOptions(sample_ratio=0)
    with pytest.raises(KvtierError, match="window"):
        SampleOptions(window_seconds=-1)


def test_cli_sample_and_convert(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli.jsonl"
    result = runner.invoke(
        app,
        [
            "trace",
            "sample",
            str(SHARED_TRACE),
            "-o",
            str(out),
            "--sample-ratio",
            "0.25",
            "--max-single-turn-ratio",
            "0.5",
            "--seed",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "cross_session_hit_share" in result.output
    conv = tmp_path / "conv.jsonl"
    result = runner.invoke(app, ["trace", "convert", str(SHARED_TRACE), "-o", str(conv)])
    assert result.exit_code == 0, result.output
    converted = analyze_file(conv)  # explicit sessions now, same figures
    assert converted["sessions"]["count"] == 2747
    assert converted["blocks"]["unique"] == 43924
