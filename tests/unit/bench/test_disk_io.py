"""``kvtier bench disk-io`` runs each path over real files and leaves nothing behind (its
figures are a benchmark's, not asserted here)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvtier.bench.micro import disk_io
from kvtier.cli import app


def test_every_path_is_timed_and_its_files_removed(tmp_path: Path) -> None:
    # two records a segment: the third chunk starts a second segment file
    report = disk_io.run(tmp_path, 64 << 10, chunks=3, repeat=2, segment_bytes=2 * (68 << 10))
    for times in (report.write_s, report.read_s):
        assert sorted(times) == sorted(disk_io.PATHS)
        assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in times.values())
    assert list(tmp_path.iterdir()) == []
    assert "O_DIRECT" in disk_io.format_report(report)


def test_the_command_refuses_a_chunk_o_direct_cannot_write(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "disk-io", "--dir", str(tmp_path), "--chunk", "5000", "--chunks", "1"]
    )
    assert result.exit_code != 0
    assert "multiple of 4 KiB" in str(result.exception)
