"""Every folder of product modules is a package (one without ``__init__.py`` would be left out
of the wheel; building and installing the wheel: tests/integration/test_packaging.py)."""

from __future__ import annotations

from support.layout import ROOT, product_files


def test_every_product_folder_is_a_package() -> None:
    """A folder of Python modules without ``__init__.py`` would be left out of the wheel."""
    missing = [
        str(path.parent.relative_to(ROOT))
        for path in product_files()
        if path.parent != ROOT and not (path.parent / "__init__.py").exists()
    ]
    assert not missing, f"folders without __init__.py: {sorted(set(missing))}"
