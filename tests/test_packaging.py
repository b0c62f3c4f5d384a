"""The distribution: every package folder is shipped, generated code is fresh, the README's
demonstration command works."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> dict[str, Path]:
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            name = ".".join([package, *rel.parts]) if rel.parts else package
            found[name] = init.parent
    return found


def test_every_package_folder_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert set(_package_folders()) == listed


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
            assert f"{package.replace('.', '/')}/{module.name}" in names
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


def test_demo_command_runs(tmp_path: Path) -> None:
    """`kvtier demo` (the README's first command, after install) works on embedded defaults."""
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--no-keep-running"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={
            "PATH": "/usr/bin:/bin",
            "KVTIER_STORE__RUN_DIR": str(tmp_path / "run"),
            "KVTIER_STORE__POOL__CAPACITY": "512MiB",
        },
    )
    assert result.returncode == 0, result.stderr
    assert "bytes identical: True" in result.stdout
    assert "64 chunks already stored" in result.stdout
    assert "shared memory released" in result.stdout


def test_version_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    import kvtier

    assert out == kvtier.__version__
