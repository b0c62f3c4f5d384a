"""``python -m kvtier trace analyze --json`` writes the shared trace's reference figures
(/work/shared/data/traces/README.md; the analysis itself, in this process:
tests/unit/traces/test_analyze.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.trace_helpers import SHARED_TRACE


def test_cli_json_matches_reference(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "trace",
            "analyze",
            str(SHARED_TRACE),
            "--no-progress",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    data = json.loads(out.read_text())
    assert data["blocks"]["unique"] == 43924
    assert round(data["infinite_cache"]["hit_ratio_tokens"], 4) == 0.6512
