"""Import-time fix that lets vLLM 0.32 (CPU) run in the same process as LMCache 0.5.x.

The benchmark driver imports this before vLLM when it runs the LMCache peer in-process
(``"preload"`` in its spec); nothing else loads it.

The problem: LMCache's connector imports numba (``lmcache.v1.multiprocess.token_hasher``:
``from numba import njit``), which loads ``llvmlite.binding.ffi``. Its module-level ``lib``
is an ``_lib_wrapper`` whose ``__getattr__`` forwards *every* name to the ctypes CDLL,
including ``__dict__``, and wraps the result in a ``_lib_fn_wrapper``. vLLM's CPU platform then
registers its Triton-kernel overrides (``vllm/triton_utils/dispatcher.py _rebind_kernels``)
by scanning every module namespace and calling ``vars(value).get("kernel")``; for that object
``vars()`` returns the ``_lib_fn_wrapper`` and the engine dies at start with

    AttributeError: '_lib_fn_wrapper' object has no attribute 'get'

(only when numba is already imported when the worker initialises: always with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The fix makes ``_lib_wrapper.__getattr__`` refuse dunder
names, as a normal object would; llvmlite itself never looks up dunders through it.
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "llvmlite.binding.ffi"


def _patch(module) -> None:
    cls = getattr(module, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_kvtier_dunder_patch", False):
        return
    original = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    cls._kvtier_dunder_patch = True


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of llvmlite.binding.ffi to patch it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched_exec(module, _exec=exec_module):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = patched_exec  # type: ignore[method-assign]
                return spec
        return None


def install() -> None:
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
        return
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


install()
