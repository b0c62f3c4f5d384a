"""The unit tier's rule, enforced: a unit test starts no process. While each test under
tests/unit is set up and runs, every way to start one (``subprocess``, ``multiprocessing``,
``os.fork``/``posix_spawn``/``system``) raises instead, so a test that needs a store, an index,
Redis, the transfer engine or vLLM as a process fails here at once, naming the rule: it
belongs to tests/integration, tests/engine or tests/drills.

One process is not the test's but the product's: an in-process store (``NodeStore``) starts
its pool segment's watchdog (``kvtier.store.pool.watchdog``), a tiny process that unlinks the
segment if this one dies. Here the store runs without it, as it does when the watchdog cannot
start (the next store's cleanup covers a crash); tests/integration runs stores with theirs.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Iterator

import pytest

import kvtier.store.node

# matplotlib builds its font cache on first use by running fc-list: a process of the
# library's, not the test's. Built here, before any test runs (once per machine).
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager
except ImportError:  # the core install has no matplotlib; its tests skip
    pass

# vLLM inspects a model class in a subprocess of its own the first time a machine builds a
# config of it (then from its model-info cache, under VLLM_CACHE_ROOT): a process of the
# library's, not the test's. Done here, before any test runs, for the one class the unit tier
# builds configs of (the tiny Llama).
try:
    from vllm.model_executor.models.registry import ModelRegistry
except ImportError:  # the core install has no vLLM; its tests skip
    pass
else:
    if ModelRegistry._try_inspect_model_cls("LlamaForCausalLM") is None:
        raise RuntimeError("vLLM could not inspect LlamaForCausalLM (its log says why)")

RULE = "a unit test starts no process (tests/unit/conftest.py): move it to tests/integration"


class ProcessStarted(AssertionError):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise ProcessStarted(RULE)


# subprocess (and asyncio's subprocesses) and multiprocessing's spawn and forkserver all end
# in fork_exec; multiprocessing's fork in os.fork
_STARTS = [
    (_posixsubprocess, "fork_exec"),
    (subprocess, "_fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]


def _no_processes() -> pytest.MonkeyPatch:
    patch = pytest.MonkeyPatch()
    for module, name in _STARTS:
        if hasattr(module, name):
            patch.setattr(module, name, _refuse)
    patch.setattr(kvtier.store.node, "start_watchdog", lambda paths: None)
    return patch


# Hooks, not an autouse fixture: the guard must also cover the fixtures of wider scope a test
# sets up (a module's store, the session's Redis), and only for tests in this folder. Not
# teardown: the last test of a run also tears down the session's fixtures of other tiers.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    patch = _no_processes()
    try:
        return (yield)
    finally:
        patch.undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    patch = _no_processes()
    try:
        return (yield)
    finally:
        patch.undo()
