"""The distribution: a built wheel holds every package, generated code is fresh, the
``kvtier`` command runs (every folder being a package: tests/unit/test_packaging.py; the
README's demonstration command: tests/engine/test_demo.py)."""

from __future__ import annotations

import filecmp
import subprocess
import sys
import zipfile
from pathlib import Path

from support.layout import ROOT, import_name, product_files


def _package_folders() -> dict[str, Path]:
    """The product's packages by import name: the root is ``kvtier``, each folder below it
    ``kvtier.<path>``."""
    return {"kvtier": ROOT} | {import_name(p): p.parent for p in product_files("__init__.py")}


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


def test_version_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    import kvtier

    assert out == kvtier.__version__
