"""Type-check kvtier with mypy (what CI runs: ``make lint``).

The repository root is the package ``kvtier``, but a checkout's folder may have any name, and
mypy names modules after folders. So mypy runs in a scratch folder holding one link,
``kvtier -> <this checkout>``, and checks the package ``kvtier`` there with the settings in
pyproject.toml; tests/, scripts/ and docs/ are not part of the package.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    packages = sys.argv[1:] or ["kvtier"]
    with tempfile.TemporaryDirectory(prefix="kvtier-typecheck-") as scratch:
        (Path(scratch) / "kvtier").symlink_to(ROOT, target_is_directory=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        cmd += ["--cache-dir", str(ROOT / ".mypy_cache")]
        for package in packages:
            cmd += ["-p", package]
        return subprocess.call(cmd, cwd=scratch)


if __name__ == "__main__":
    sys.exit(main())
