"""The GPU tests run on machines that cannot carry vLLM's CUDA build: there the shim of the
few vLLM types the copy path imports (``vllm_shim/``, held to vLLM's real classes by
tests/integration/test_vllm_shim.py) stands in for it. Where vLLM is installed, the real one
is used. The shim is registered as the package ``vllm`` (its submodules load from its folder),
not put on ``sys.path``; ``support.kv_rig`` imports through pytest's ``pythonpath`` alike when
this folder runs alone (``pytest tests/gpu --confcutdir tests/gpu``, as on the lent GPU
machine; scripts/gpu_check.sh also puts the shim on ``PYTHONPATH`` for its benchmarks)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SHIM = Path(__file__).parent / "vllm_shim" / "vllm"


def _register_shim() -> None:
    spec = importlib.util.spec_from_file_location(
        "vllm", SHIM / "__init__.py", submodule_search_locations=[str(SHIM)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm"] = module
    spec.loader.exec_module(module)


if importlib.util.find_spec("vllm") is None:
    _register_shim()
