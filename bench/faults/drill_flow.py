"""What the store drills of ``drills.py`` are made of: the driver's control phases, a drill's
store and its lease readings, and ``poison_flow``, the shape most drills follow.

``poison_flow``: an instance stores prompts A (300 tokens, 4 chunks of 64), resets its GPU
cache, then runs prompts B (A's first 256 tokens + 200 new ones: loads A's 4 chunks and
completes 3 new chunks in the same step) while a fault hits the load. Then, the fault off, it
stores A again (restoring whatever the fault made the store drop), resets, and runs B from
DRAM (448 tokens). A fault that let the instance commit chunks computed over blocks that were
never loaded shows up as wrong tokens there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.bench.faults.run import (
    DrillContext,
    DrillResult,
    add_counters,
    generate,
    tally,
)
from kvtier.testing.services import Service, start_store, store_leases

RESET = {"op": "reset_prefix_cache"}
SETTLE = {"op": "settle"}  # the engine idle and every store call its connector queued done
METRICS = {"op": "metrics"}
DISARM = {"op": "disarm"}


def drill_store(ctx: DrillContext, capacity: str = "256MiB", **kwargs: Any) -> Service:
    """A node store of its own for one drill (``start_store``'s keywords pass through)."""
    return start_store(ctx.run_dir, capacity, "drill-node", remote=False, **kwargs)


def live_leases(store: Service) -> dict:
    """A phase reading the store's lease count while the engine is alive and idle: a lease
    the connector leaked is still held then (once the engine exits, closing its session
    releases everything, which is why reading after the run could never show a leak). The
    store is asked for as long as its process runs (``store_leases``), however slow to
    answer a loaded machine makes it."""
    return {"op": "store_leases", "address": store.address, "pid": store.pid}


def leases_at_exit(store: Service) -> int:
    """Leases still held at the store once every instance has exited (0 for a dead store:
    its leases died with it). Catches leases of clients without a session only: drills
    read ``live_leases`` while the engine runs. Asked for as long as the store runs."""
    return store_leases(store.address, store.pid)


def poison_flow(
    ctx: DrillContext,
    fault: Callable[[Service], dict],
    extra: dict | None = None,
    seed: int = 1,
) -> DrillResult:
    """One instance: A (twice, reset between), reset, B with ``fault`` armed for every load;
    then, fault off and GPU cache reset, A again (restoring what the fault made the store
    drop), reset, and B from DRAM: whatever the faulty phase committed is read back and
    compared."""
    result = DrillResult("", "")
    prompts = ctx.prompts(seed)
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address} | (extra or {})
        # settled before each B: A's saves are committed and checksummed when B looks up
        # (else a B that finds nothing to load never meets the fault, and the drill counts one
        # recompute too few; with verify_loads a lookup ends before an unsummed chunk)
        settled = SETTLE | {"address": store.address, "pid": store.pid}
        # A twice, vLLM's cache reset between: the second pass loads what the first stored
        # and stores what it did not (a save that failed on a loaded 2-core host left a B
        # with nothing to load, which never met the fault: a CI run counted 0 recomputes)
        phases = [generate(prompts.a), settled, RESET, generate(prompts.a), settled, RESET]
        phases += [fault(store) | {"every": True}, generate(prompts.b), live_leases(store)]
        phases += [DISARM, RESET, generate(prompts.a), SETTLE, RESET, generate(prompts.b)]
        phases += [live_leases(store), METRICS]
        out = ctx.vllm(phases, config)
        reference = ctx.reference(prompts.a + prompts.b)
        tally(result, out[0], prompts.a, reference)
        tally(result, out[3], prompts.a, reference)
        tally(result, out[7], prompts.b, reference, timed=True)
        tally(result, out[11], prompts.a, reference)
        tally(result, out[14], prompts.b, reference)
        add_counters(result, out[-1])
        result.leaked_leases = max(out[8], out[15], leases_at_exit(store))
    finally:
        store.stop()
    return result
