"""The shim of vLLM types in tests/gpu/vllm_shim (what the GPU tests import where vLLM's CUDA
build cannot be installed) matches vLLM's classes, and is all of vLLM the copy path imports:
a child with the shim first on its path runs the worker, the copies, the GPU tests' rig and
``kvtier bench kv-copy``."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHIM = TESTS / "gpu" / "vllm_shim"


def _shim_module(name: str):
    path = SHIM / (name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(f"shim_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_shim_matches_vllms_classes() -> None:
    import vllm.distributed.kv_transfer.kv_connector.v1.base as real

    shim = _shim_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    names = [
        n for n, v in vars(shim).items() if inspect.isclass(v) and v.__module__ == shim.__name__
    ]
    assert sorted(names) == ["KVConnectorMetadata", "KVConnectorWorkerMetadata"]
    for name in names:
        ours, theirs = getattr(shim, name), getattr(real, name)
        assert [c.__name__ for c in ours.__mro__[1:]] == [c.__name__ for c in theirs.__mro__[1:]]
        assert ours.__abstractmethods__ == theirs.__abstractmethods__
        for method in ours.__abstractmethods__:
            assert inspect.signature(getattr(ours, method)) == inspect.signature(
                getattr(theirs, method)
            )


def test_the_copy_path_imports_no_other_vllm_module() -> None:
    """With the shim first on the path, any vLLM module beyond it would fail to import: the
    worker, the copies, the GPU tests' rig and ``kvtier bench kv-copy`` must not need one."""
    code = (
        "import sys\n"
        "import kvtier.connector.worker, kvtier.connector.paged_kv, kvtier.bench.micro.kv_copy\n"
        "import support.kv_rig, vllm\n"
        "from kvtier.cli import main\n"
        "assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__\n"
        "sys.argv = ['kvtier', 'bench', 'kv-copy', '--help']\n"
        "main()\n"
    )
    path = [str(SHIM), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(SHIM)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},  # before site-packages
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--device" in proc.stdout
