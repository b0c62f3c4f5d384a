"""The distribution: every package folder is shipped, generated code is fresh, the README's
demonstration command works."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_PRODUCT = {"tests", "scripts", "docs", "docker", "build"}


def _package_folders() -> dict[str, Path]:
    """The product's packages by import name: the root is ``kvtier``, each folder below it
    ``kvtier.<path>``."""
    found = {"kvtier": ROOT}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and rel.parts[0] not in NOT_PRODUCT and not rel.parts[0].startswith("."):
            found[".".join(["kvtier", *rel.parts])] = init.parent
    return found


def test_every_product_folder_is_a_package() -> None:
    """A folder of Python modules without ``__init__.py`` would be left out of the wheel."""
    missing = []
    for path in ROOT.rglob("*.py"):
        rel = path.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in NOT_PRODUCT or rel.parts[0].startswith(".")):
            continue
        if "__pycache__" not in rel.parts and not (path.parent / "__init__.py").exists():
            missing.append(str(rel))
    assert not missing, f"folders without __init__.py: {sorted(set(missing))}"


def test_wheel_holds_the_namespace(tmp_path: Path) -> None:
    """A regular (non-editable) install gets every module under kvtier/."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, folder in _package_folders().items():
        for module in folder.glob("*.py"):
            if package == "kvtier" and module.name == "setup.py":
                assert "kvtier/setup.py" not in names
                continue
            assert f"{package.replace('.', '/')}/{module.name}" in names
    assert not any(n.startswith(("kvtier/tests/", "kvtier/scripts/")) for n in names)
    assert "kvtier/store/proto/store.proto" in names
    assert "kvtier/index/proto/index.proto" in names
    assert "kvtier/py.typed" in names


def test_generated_protos_are_up_to_date(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    copy.mkdir()
    packages = ["store", "index"]  # every folder with a proto/ that gen_protos.sh builds
    sources = [str(ROOT / p) for p in packages]
    subprocess.run(["cp", "-r", *sources, str(ROOT / "scripts"), str(copy)], check=True)
    subprocess.run(
        ["bash", str(copy / "scripts" / "gen_protos.sh")],
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    for package in packages:
        for generated in (ROOT / package / "proto").glob("*_pb2*"):
            fresh = copy / package / "proto" / generated.name
            assert filecmp.cmp(generated, fresh, shallow=False), (
                f"{package}/proto/{generated.name} is stale: run scripts/gen_protos.sh"
            )


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


def test_version_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    import kvtier

    assert out == kvtier.__version__
