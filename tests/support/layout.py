"""The product's files in this checkout: the repository root is the package ``kvtier``, each
file below it ``kvtier.<path>``, except the folders that are not shipped (``NOT_SHIPPED`` in
setup.py). Walked folder by folder from the root, so a checkout's .venv is never read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# results/: what `kvtier bench` writes by default (git-ignored; a cluster run leaves LMCache's
# preload sitecustomize.py there)
NOT_PRODUCT = frozenset({"tests", "scripts", "docs", "docker", "build", "results"})


def product_files(pattern: str = "*.py") -> Iterator[Path]:
    """Every product file matching ``pattern``: the root's own, and those in its folders."""
    for entry in sorted(ROOT.iterdir()):
        if entry.name.startswith(".") or entry.name in NOT_PRODUCT:
            continue
        if entry.is_dir():
            yield from (p for p in entry.rglob(pattern) if "__pycache__" not in p.parts)
        elif entry.match(pattern):
            yield entry


def import_name(path: Path) -> str:
    """``store/state/core.py`` -> ``kvtier.store.state.core``; a package's ``__init__.py`` is
    the package."""
    parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
    return ".".join(["kvtier", *parts])
