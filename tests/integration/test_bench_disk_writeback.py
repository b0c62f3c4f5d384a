"""``kvtier bench disk-writeback`` drives a real store with the disk tier past its pool, in
both modes, and reads eviction's counters (its figures are a benchmark's, not asserted)."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.micro import disk_writeback


def test_each_mode_runs_past_the_pool_and_counts_what_eviction_took(tmp_path: Path) -> None:
    report = disk_writeback.run(
        tmp_path,
        pools=[16 << 20],
        rates=[1.0],
        chunk_bytes=1 << 20,
        seconds=0.5,
        batch_bytes=4 << 20,
        floor_seconds=0.2,
        warmup_s=0.2,
    )
    assert [row["mode"] for row in report["rows"]] == list(disk_writeback.MODES)
    for row in report["rows"]:
        assert row["evictions"] > 0  # new chunks past a full pool: eviction ran
        assert 0 <= row["dirty_evictions"] <= row["evictions"]
        assert 0.0 <= row["coverage"] <= 1.0
    assert report["disk_write_gbs"] > 0
    assert list(tmp_path.iterdir()) == []  # the chunk files and the floor's file are gone
    assert "on disk when evicted" in disk_writeback.format_report(report)
