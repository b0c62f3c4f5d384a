"""The GPU tests run on machines that cannot carry vLLM's CUDA build: there the shim of the
few vLLM types the copy path imports (``vllm_shim/``, held to vLLM's real classes by
tests/test_kv_layouts.py) stands in for it. Where vLLM is installed, the real one is used.
``tests/`` goes on the path so ``gpu.kv_rig`` imports alike when this folder runs alone
(``pytest tests/gpu --confcutdir tests/gpu``, as on the lent GPU machine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))
if importlib.util.find_spec("vllm") is None:
    sys.path.insert(0, str(HERE / "vllm_shim"))
