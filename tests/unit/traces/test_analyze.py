"""``kvtier trace analyze`` and ``capacity`` reproduce the shared trace's reference figures
(/work/shared/data/traces/README.md) exactly, and their session and radix statistics are right
on traces small enough to check by hand."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from kvtier.traces.analyze import analyze, analyze_file
from kvtier.traces.capacity import capacity_curve
from kvtier.traces.formats import read_trace

from support.trace_helpers import SHARED_TRACE, req, write_trace


@pytest.fixture(scope="module")
def report() -> dict:
    return analyze_file(SHARED_TRACE)


def test_reference_figures(report: dict) -> None:
    assert report["requests"] == 3993
    assert report["duration_ms"] == 1_022_025
    inp = report["input_tokens"]
    assert round(inp["mean"], 1) == 15325.5
    assert [round(inp[k]) for k in ("p50", "p90", "p99", "max")] == [11587, 38611, 66456, 191378]
    out = report["output_tokens"]
    assert (round(out["mean"], 1), round(out["p50"]), round(out["p90"])) == (149.1, 69, 389)
    assert round(report["blocks_per_request_mean"], 2) == 30.52
    assert report["blocks"] == {"unique": 43924, "total": 121877}
    inf = report["infinite_cache"]
    assert round(inf["hit_ratio_blocks"], 4) == 0.6396
    assert round(inf["hit_ratio_tokens"], 4) == 0.6512
    assert round(inf["requests_with_hit"] * 100, 1) == 44.6


def test_reference_lru_capacity_table() -> None:
    reference = {1000: 0.0825, 5860: 0.3094, 10000: 0.4235, 30000: 0.6242, 100000: 0.6396}
    result = capacity_curve(read_trace(SHARED_TRACE), list(reference), ["lru", "s3fifo"])
    lru = {r["capacity_blocks"]: r for r in result["rows"] if r["policy"] == "lru"}
    assert {cap: round(lru[cap]["hit_ratio"], 4) for cap in reference} == reference
    assert [round(lru[c]["capacity_tokens"] / 1e6, 1) for c in reference] == [
        0.5,
        3.0,
        5.1,
        15.4,
        51.2,
    ]
    s3 = {r["capacity_blocks"]: r["hit_ratio"] for r in result["rows"] if r["policy"] == "s3fifo"}
    # Both policies converge to the infinite cache once everything fits.
    assert round(s3[100000], 4) == round(result["infinite_hit_ratio"], 4) == 0.6396
    assert s3[5860] != lru[5860]["hit_ratio"]  # the policies do differ below that


def test_derived_sessions_and_reuse_split(tmp_path: Path) -> None:
    system = [1, 2]  # a shared two-block system prompt
    lines = [
        req(0, [*system, 10, 11]),  # A turn 1
        req(1, [*system, 20]),  # B turn 1: shares only the system prompt -> cross
        req(2, [*system, 10, 11, 12, 13]),  # A turn 2: extends A's prompt -> intra
        req(3, [*system, 10, 11, 12, 13, 14]),  # A turn 3
        req(4, [99]),  # C: nothing shared
        req(5, [*system, 30]),  # D: system prompt only -> new session, cross
    ]
    report = analyze(read_trace(write_trace(tmp_path / "t.jsonl", lines)), derive_sessions=True)
    s = report["sessions"]
    assert s["count"] == 4
    assert s["turns_max"] == 3
    assert s["single_turn_share"] == 3 / 4
    # hits: B 2 (cross), A2 4 (intra: 2 system blocks A used before + 10, 11), A3 6 (intra),
    # D 2 (cross)
    hits = 2 + 4 + 6 + 2
    assert report["infinite_cache"]["hit_blocks"] == hits
    assert s["intra_session_hit_share"] == pytest.approx(10 / hits)
    assert s["cross_session_hit_share"] == pytest.approx(4 / hits)


def test_explicit_sessions_split_shared_blocks(tmp_path: Path) -> None:
    lines = [
        req(0, [1, 2, 3], session="a", turn=1),
        req(1, [1, 2, 4], session="b", turn=1),  # 2 cross hits
        req(2, [1, 2, 4, 5], session="a", turn=2),  # 1, 2 used by a before; 4 only by b
        req(3, [1, 2, 4, 5, 6], session="b", turn=2),  # 1, 2, 4 intra; 5 only by a
    ]
    report = analyze(read_trace(write_trace(tmp_path / "s.jsonl", lines)), derive_sessions=False)
    s = report["sessions"]
    assert s["count"] == 2 and s["single_turn_share"] == 0
    assert report["infinite_cache"]["hit_blocks"] == 2 + 3 + 4
    assert s["intra_session_hit_share"] == pytest.approx((2 + 3) / 9)


def test_prefix_repetition_counts_radix_nodes(tmp_path: Path) -> None:
    lines = [
        req(0, [1, 2, 3, 4]),
        req(1, [1, 2, 3, 5]),
        req(2, [1, 2, 3, 5, 6]),
        req(3, [1, 7]),
        req(4, [8]),
    ]
    report = analyze(
        read_trace(write_trace(tmp_path / "r.jsonl", lines)),
        derive_sessions=True,
        repetition_tokens=(512, 1536, 2048),
        repetition_counts=(2, 3, 4),
    )
    rows = {r["min_tokens"]: r["counts"] for r in report["prefix_repetition"]["rows"]}
    # radix nodes: [1] x4, [1,2,3] x3, [1,2,3,5] x2, and singletons (leaves) x1.
    assert rows[512] == {2: 3, 3: 2, 4: 1}
    assert rows[1536] == {2: 2, 3: 1, 4: 0}
    assert rows[2048] == {2: 1, 3: 0, 4: 0}
    assert report["prefix_repetition"]["inconsistent_blocks"] == 0


def test_large_hash_ids_switch_to_dense_slots(tmp_path: Path) -> None:
    big = 1 << 60
    lines = [req(0, [5, 6]), req(1, [big, big + 1]), req(2, [5, 6, 7]), req(3, [big, big + 2])]
    report = analyze(read_trace(write_trace(tmp_path / "b.jsonl", lines)), derive_sessions=True)
    assert report["blocks"] == {"unique": 6, "total": 9}
    assert report["infinite_cache"]["hit_blocks"] == 2 + 1


def _peak_bytes(path: Path) -> int:
    tracemalloc.start()
    try:
        analyze_file(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_analysis_streams(tmp_path: Path) -> None:
    """Memory grows by a few bytes per request, not by a request object per request."""

    def make(n: int) -> Path:
        # 50 conversations, each turn extending its own prompt by one block: few blocks,
        # many requests, so per-request memory dominates.
        lines = (
            req(i, [c * 1000 + k for k in range(1 + (i // 50) % 5)])
            for i, c in ((i, i % 50) for i in range(n))
        )
        return write_trace(tmp_path / f"m{n}.jsonl", lines)

    small, large = make(2_000), make(10_000)
    analyze_file(small)  # first-use allocations (lazy imports, caches) out of the way
    small, large = _peak_bytes(small), _peak_bytes(large)
    per_request = (large - small) / 8_000
    # Holding the requests costs ~320 B each here (struct + list + ints); the analysis keeps
    # two lengths per request in arrays that grow by doubling (~40 B measured).
    assert per_request < 100, per_request


def test_hash_ids_that_are_not_prefix_hashes_are_reported(tmp_path: Path) -> None:
    # Block 3 appears under parent 2, then under parent 9: not a prefix hash.
    lines = [req(0, [1, 2, 3]), req(1, [9, 3, 4]), req(2, [1, 2, 3, 4])]
    report = analyze(read_trace(write_trace(tmp_path / "x.jsonl", lines)), derive_sessions=True)
    assert report["prefix_repetition"]["inconsistent_blocks"] == 1  # 3 met under 9
    assert report["blocks"] == {"unique": 5, "total": 10}
    assert report["infinite_cache"]["hit_blocks"] == 0 + 0 + 4
