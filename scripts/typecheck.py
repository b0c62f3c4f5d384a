"""Type-check kvtier's packages with mypy (what CI runs: ``make lint``).

The repository maps folders onto the ``kvtier`` namespace (``package-dir`` in
pyproject.toml: core -> kvtier, store -> kvtier.store, ...), which mypy cannot follow through
an editable install. This builds ``.typecheck/kvtier`` as a tree of symlinks laid out as the
installed package, then runs mypy on it with the settings in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".typecheck"


def build_tree() -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = project["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    for package, folder in mapping.items():
        target = TREE.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / folder).rglob("*"):
            if "__pycache__" in src.parts or src.suffix not in (".py", ".pyi", ".typed"):
                continue
            rel = src.relative_to(ROOT / folder)
            if (
                rel.parts
                and (ROOT / folder / rel.parts[0]).is_dir()
                and any(f"{package}.{rel.parts[0]}" == other for other in mapping)
            ):
                continue  # a subpackage mapped on its own
            dst = target / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src, dst)
    return TREE / "kvtier"


def main() -> int:
    build_tree()
    packages = sys.argv[1:] or ["kvtier"]
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(ROOT / ".mypy_cache")]
    for package in packages:
        cmd += ["-p", package]
    return subprocess.call(cmd, cwd=TREE)


if __name__ == "__main__":
    sys.exit(main())
