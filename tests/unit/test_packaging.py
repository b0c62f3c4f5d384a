"""Every folder of product modules is a package (one without ``__init__.py`` would be left out
of the wheel; building and installing the wheel: tests/integration/test_packaging.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_PRODUCT = {"tests", "scripts", "docs", "docker", "build"}


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
