"""``kvtier demo``, the README's first command after install: a whole cluster with vLLM CPU
instances comes up, answers, and stops leaving nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.vllm
def test_demo_command_runs(tmp_path: Path) -> None:
    """`kvtier demo` (the README's first command, after install): a cluster comes up, the
    prompt is a miss, a GPU hit, a node-DRAM hit and a remote hit by vLLM's own counters, and
    everything stops cleanly: no process, no shared-memory segment left."""
    import os

    before = set(os.listdir("/dev/shm"))
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--no-keep-running", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "KVTIER_LOG_LEVEL": "warning"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "│" in line and "ms" not in line]
    assert len(rows) == 4 and all(line.rstrip(" │").endswith("yes") for line in rows), rows
    assert "cluster stopped" in result.stdout
    left = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("kvtier-node")}
    assert not left
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not leftover.stdout.strip()
