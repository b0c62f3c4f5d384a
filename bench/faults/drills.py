"""The fault drills of ``kvtier bench faults`` (and of ``tests/drills/test_fault_drills.py``).

Most drills follow one shape, ``drill_flow.poison_flow``: prompts A are stored, then prompts
B, which load A's chunks and complete new ones in the same step, run while a fault hits the
load; then, the fault off, B is read back from DRAM and compared. The disk tier's drills are
``disk_drills.py``'s; ``DRILLS`` lists them all.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.bench.faults.disk_drills import DISK_DRILLS
from kvtier.bench.faults.drill_flow import (
    DISARM,
    METRICS,
    RESET,
    SETTLE,
    drill_store,
    leases_at_exit,
    live_leases,
    poison_flow,
)
from kvtier.bench.faults.run import (
    DrillContext,
    DrillResult,
    add_counters,
    generate,
    tally,
)
from kvtier.testing.models import make_family_model
from kvtier.testing.ports import free_port
from kvtier.testing.services import Service, kvtier_argv, process_state, store_args

# -- 1. a store restarted between lookup and load ---------------------------------------------


def restart(when: str) -> Callable[[DrillContext], DrillResult]:
    def drill(ctx: DrillContext) -> DrillResult:
        port = free_port()
        args = store_args(ctx.run_dir, "256MiB", "drill-node", remote=False, grpc_port=port)
        ready_file = ctx.workdir / f"restarted-{when}.json"
        ready_file.unlink(missing_ok=True)
        store = drill_store(ctx, grpc_port=port)

        def fault(s: Service) -> dict:
            return {
                "op": "fault",
                "kind": "restart_store",
                "pid": s.proc.pid,
                "argv": kvtier_argv(args),
                "ready_file": str(ready_file),
                "when": when,
            }

        try:
            result = _restart_flow(ctx, store, fault)
            if ready_file.exists():
                result.leaked_leases = leases_at_exit(_restarted(ready_file))
        finally:
            store.stop()
            _stop_restarted(ready_file)
        return result

    return drill


def _restart_flow(
    ctx: DrillContext, store: Service, fault: Callable[[Service], dict]
) -> DrillResult:
    """Per request: A, reset, the store restarts between B's lookup and load, B. The new store
    is empty, so each B pays its own restart. Then B again from whatever is stored now."""
    result = DrillResult("", "")
    prompts = ctx.prompts(2)
    config = {"store_address": store.address}
    phases: list[dict] = []
    for i, b in enumerate(prompts.b):
        # settled: A's saves are committed before B looks up (else B finds nothing to load and
        # the fault, armed for B's load, never fires), however long the store takes
        phases += [generate([prompts.a[i]]), RESET, SETTLE, fault(store), generate([b])]
    phases += [DISARM, RESET, generate(prompts.b), METRICS]
    out = ctx.vllm(phases, config)
    reference = ctx.reference(prompts.a + prompts.b)
    per_request = out[: 5 * len(prompts.b)]
    outs = [o for phase in per_request if isinstance(phase, list) for o in phase]
    tally(result, outs[0::2], prompts.a, reference)
    tally(result, outs[1::2], prompts.b, reference, timed=True)
    tally(result, out[-2], prompts.b, reference)
    add_counters(result, out[-1])
    return result


def _restarted(ready_file: Path) -> Service:
    """The store the fault started last (not this process's child): its address and pid."""
    import json
    import subprocess

    ready = json.loads(ready_file.read_text())
    return Service(subprocess.Popen(["true"]), ready)  # address, and pid from ``ready``


def _stop_restarted(ready_file: Path) -> None:
    """Stop the store the fault started last as ``Service.stop`` stops one: SIGTERM, then
    SIGKILL if it still runs 20 s later; returns once it is gone."""
    import contextlib
    import json
    import os
    import signal

    if not ready_file.exists():
        return
    pid = json.loads(ready_file.read_text())["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        kill_at = time.monotonic() + 20
        while process_state(pid) != "gone":
            if time.monotonic() > kill_at:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


# -- 2. a failed load in a step that also completes chunks ------------------------------------


def lapsed_lease(ctx: DrillContext) -> DrillResult:
    return poison_flow(
        ctx, lambda s: {"op": "fault", "kind": "stall", "seconds": 0.9}, {"load_lease_ttl_s": 1.0}
    )


def checksum_mismatch(ctx: DrillContext) -> DrillResult:
    def fault(s: Service) -> dict:
        return {"op": "fault", "kind": "corrupt_chunk", "segment": s.ready["segment"], "chunk": 1}

    return poison_flow(ctx, fault, {"verify_loads": True}, seed=3)


def copy_exception(ctx: DrillContext) -> DrillResult:
    return poison_flow(ctx, lambda s: {"op": "fault", "kind": "copy_error"}, seed=4)


def missing_segment(ctx: DrillContext) -> DrillResult:
    def fault(s: Service) -> dict:
        return {"op": "fault", "kind": "unlink_segment", "segment": s.ready["segment"]}

    return poison_flow(ctx, fault, seed=5)


def store_killed_mid_load(ctx: DrillContext) -> DrillResult:
    def fault(s: Service) -> dict:
        return {
            "op": "fault",
            "kind": "kill_store",
            "pid": s.proc.pid,
            "segment": s.ready["segment"],
        }

    return poison_flow(ctx, fault, seed=6)


# -- 3. weights that differ under one name ------------------------------------------------------


def weights_changed_in_place(ctx: DrillContext) -> DrillResult:
    """The same model path serves other weights (a fine-tune saved over it): instance 2 must
    not load what instance 1 computed with the old weights."""
    result = DrillResult("", "")
    prompts = ctx.prompts(7)
    model = ctx.workdir / "model-in-place"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(ctx.model, model)
    other = make_family_model(ctx.workdir / f"tiny-{ctx.family}-seed1", ctx.family, seed=1)
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address}
        first = ctx.vllm([generate(prompts.a), METRICS], config, model=model)
        shutil.copy(other / "model.safetensors", model / "model.safetensors")
        check = ctx.vllm([generate(prompts.a), METRICS], config, model=model)
        tally(result, first[0], prompts.a, ctx.reference(prompts.a, ctx.model))
        tally(result, check[0], prompts.a, ctx.reference(prompts.a, other), timed=True)
        add_counters(result, first[-1])
        add_counters(result, check[-1])
        result.leaked_leases = leases_at_exit(store)
    finally:
        store.stop()
    return result


def rope_override(ctx: DrillContext) -> DrillResult:
    """Same weights, other rope scaling (hf_overrides): other KV, so no sharing."""
    result = DrillResult("", "")
    prompts = ctx.prompts(8)
    overrides = {
        "hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    }
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address}
        first = ctx.vllm([generate(prompts.a), METRICS], config)
        check = ctx.vllm([generate(prompts.a), METRICS], config, engine_args=overrides)
        tally(result, first[0], prompts.a, ctx.reference(prompts.a))
        reference = ctx.reference(prompts.a, None, 1, **overrides)
        tally(result, check[0], prompts.a, reference, timed=True)
        add_counters(result, first[-1])
        add_counters(result, check[-1])
        result.leaked_leases = leases_at_exit(store)
    finally:
        store.stop()
    return result


# -- 7. inputs and states that used to raise inside the scheduler -------------------------------


def salted(prompts: list[list[int]], salt: str) -> list[dict]:
    return [{"tokens": p, "cache_salt": salt} for p in prompts]


def salt_with_newline(ctx: DrillContext) -> DrillResult:
    """A cache_salt vLLM accepts (line breaks, any Unicode) works, and isolates."""
    result = DrillResult("", "")
    prompts = ctx.prompts(9)
    batch = salted(prompts.a, "tenant\nb\u00e9")
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address}
        others = salted(prompts.a, "tenant-c")
        phases = [generate(batch), RESET, generate(batch), RESET, generate(others), METRICS]
        out = ctx.vllm(phases, config)
        reference = ctx.reference(batch + others)
        tally(result, out[0], batch, reference)
        tally(result, out[2], batch, reference, timed=True)
        tally(result, out[4], others, reference)
        add_counters(result, out[-1])
        if any(o.get("cached_by_source", {}).get("host") for o in out[4]):
            result.notes.append("another salt hit the first salt's chunks")
            result.wrong_tokens += 1  # isolation broken counts as wrong
        result.leaked_leases = leases_at_exit(store)
    finally:
        store.stop()
    return result


def store_down_new_salt(ctx: DrillContext) -> DrillResult:
    """The store dies; the next request brings a salt never seen (its namespace must be
    registered): a miss, not an engine crash."""
    result = DrillResult("", "")
    prompts = ctx.prompts(10)
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address}
        batch = salted(prompts.a, "fresh-tenant")
        phases = [
            generate(prompts.a[:1]),
            {"op": "signal", "pid": store.proc.pid, "signal": "SIGKILL"},
            generate(batch),
            METRICS,
        ]
        out = ctx.vllm(phases, config)
        reference = ctx.reference([*prompts.a[:1], *batch])
        tally(result, out[0], prompts.a[:1], reference)
        tally(result, out[2], batch, reference, timed=True)
        add_counters(result, out[-1])
    finally:
        store.stop()
    return result


def pool_too_small(ctx: DrillContext) -> DrillResult:
    """A pool smaller than one chunk: the store refuses the namespace; requests are misses."""
    result = DrillResult("", "")
    prompts = ctx.prompts(11)
    store = drill_store(ctx, capacity="64KiB")
    try:
        config = {"store_address": store.address, "chunk_tokens": 256, "min_hit_tokens": {}}
        out = ctx.vllm([generate(prompts.a), METRICS], config)
        tally(result, out[0], prompts.a, ctx.reference(prompts.a), timed=True)
        add_counters(result, out[-1])
    finally:
        store.stop()
    return result


# -- 9. a store that hangs ----------------------------------------------------------------------


def store_hung(ctx: DrillContext) -> DrillResult:
    """The store stops answering (SIGSTOP) while every prompt arrives at once: requests go on
    as misses within the deadlines, and the scheduler's time in kvtier per step stays within
    one ``lookup_wait_s`` budget plus its own work, however many requests wait (reported
    per step, and the longest single call)."""
    result = DrillResult("", "")
    prompts = ctx.prompts(12)
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address, "lookup_deadline_s": 0.5, "save_defer_s": 1}
        phases = [
            generate(prompts.a),
            RESET,
            {"op": "connector_timing"},
            {"op": "signal", "pid": store.proc.pid, "signal": "SIGSTOP"},
            # until the frozen store's shared view is stale (3 reaper periods, at most 3 s):
            # before that it answers the new prompts' misses itself, and no lookup would
            # reach the hung store at all
            {"op": "sleep", "seconds": 3.5},
            generate(prompts.b) | {"batch": True},
            {"op": "connector_timing"},
            {"op": "signal", "pid": store.proc.pid, "signal": "SIGCONT"},
            METRICS,
        ]
        out = ctx.vllm(phases, config)
        reference = ctx.reference(prompts.a + prompts.b)
        tally(result, out[0], prompts.a, reference)
        tally(result, out[5], prompts.b, reference, timed=True)
        add_counters(result, out[-1])
        timing = out[6]
        per_step = timing["seconds"] / max(1, timing["steps"])
        result.counters["longest_hook_call_s"] = timing["longest"]
        result.counters["scheduler_hook_s_per_step"] = per_step
        result.notes.append(
            f"scheduler hooks {per_step * 1e3:.2f} ms per step over {timing['steps']} steps "
            f"(longest call {timing['longest'] * 1e3:.1f} ms)"
        )
    finally:
        store.stop()
    return result


# -- concurrency: shared prefixes in flight, preemption, multi-token decode --------------------


DECODE = 32  # tokens per request in the concurrent drill
BLOCK_BYTES = 2 * 2 * 2 * 32 * 32 * 2  # tiny model: layers, K+V, heads, head_dim, 32 tokens, bf16
# The Qwen3-Next geometry's pages are 64 tokens x 2 KiB, shared by its attention and Mamba
# groups: 20 of them hold two 456-token prompts (8 attention + 2 state blocks each)
# Llama 4's 4 layers make a block (all layers) twice the tiny Llama's: as many blocks
FAMILY_KV_BYTES = {"qwen3-next": 20 * 64 * 2048, "llama4-local": 31 * 2 * BLOCK_BYTES}


def concurrent_failed_loads(ctx: DrillContext) -> DrillResult:
    """Every prompt in flight at once, sharing prefixes, 32 tokens each, in a KV cache that
    holds far fewer than are running (vLLM preempts), while every load's second chunk fails
    its checksum: failed loads are followed by preemptions, re-admissions on vLLM's own prefix
    cache and recomputes spread over steps. Then, faults off, the same prompts read back
    whatever the faulty phase saved (also in flight at once)."""
    result = DrillResult("", "")
    prompts = ctx.prompts(21)
    store = drill_store(ctx)
    try:
        config = {"store_address": store.address, "verify_loads": True}
        fault = {
            "op": "fault",
            "kind": "corrupt_chunk",
            "segment": store.ready["segment"],
            "chunk": 1,
            "every": True,
        }
        many = {"batch": True, "max_tokens": DECODE}
        # settled: phase a's saves committed before phase b looks them up (a lookup answered
        # from the store's view is instant: a commit still in flight would be a miss)
        phases = [generate(prompts.a), SETTLE, RESET, fault, generate(prompts.b) | many]
        phases += [live_leases(store), DISARM, RESET, generate(prompts.a), RESET]
        phases += [generate(prompts.b) | many, live_leases(store), METRICS]
        # 31 blocks of 32 tokens: two 456-token prompts fill 30; decoding past 480 tokens
        # both need one more, and vLLM preempts the newer one
        out = ctx.vllm(
            phases,
            config,
            max_model_len=960,
            max_num_seqs=8,
            kv_cache_bytes=FAMILY_KV_BYTES.get(ctx.family, 31 * BLOCK_BYTES),
        )
        first = ctx.reference(prompts.a)
        decoded = ctx.reference(prompts.b, max_tokens=DECODE)
        tally(result, out[0], prompts.a, first)
        tally(result, out[4], prompts.b, decoded, timed=True, batched=True)
        tally(result, out[8], prompts.a, first)
        tally(result, out[10], prompts.b, decoded, batched=True)
        add_counters(result, out[-1])
        preemptions = out[-1].get("vllm:num_preemptions", 0)
        result.counters["preemptions"] = preemptions
        result.notes.append(f"{preemptions:.0f} preemptions")
        result.leaked_leases = max(out[5], out[11], leases_at_exit(store))
    finally:
        store.stop()
    return result


# -- the pool full of chunks nobody may evict ---------------------------------------------------


def pool_full_pinned(ctx: DrillContext) -> DrillResult:
    """Another client holds every page of the pool (write leases never committed): saves
    answer no space, loads find nothing, outputs stay exact."""
    from kvtier.core.keys import Namespace, prompt_keys
    from kvtier.store.client.grpc import GrpcStoreClient
    from kvtier.tiers.cpu import CpuTier

    result = DrillResult("", "")
    prompts = ctx.prompts(13)
    store = drill_store(ctx, capacity="4MiB")
    tier = CpuTier(GrpcStoreClient(store.address))
    try:
        ns = Namespace(model="filler", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=1)
        ns_id = tier.register_namespace(ns, 64 << 10)
        keys = prompt_keys(ns.model_copy(update={"chunk_tokens": 1}), list(range(64)))
        held = tier.allocate(ns_id, keys, 64 << 10, ttl_s=600)
        config = {"store_address": store.address}
        out = ctx.vllm([generate(prompts.a), RESET, generate(prompts.a), METRICS], config)
        reference = ctx.reference(prompts.a)
        tally(result, out[0], prompts.a, reference)
        tally(result, out[2], prompts.a, reference, timed=True)
        add_counters(result, out[-1])
        held.abort()
        result.leaked_leases = leases_at_exit(store)
    finally:
        tier.close()
        store.stop()
    return result


DRILLS: dict[str, tuple[str, Callable[[DrillContext], DrillResult]]] = {
    "restart-before-load": (
        "the store restarts (same address) between a lookup and its load; the connector has "
        "re-attached to the new store before the load job is built",
        restart("before"),
    ),
    "restart-queued-load": (
        "the store restarts after the load job is queued, before the workers copy",
        restart("after"),
    ),
    "lapsed-lease": (
        "the scheduler stalls past the lease between lookup and load; the step completes 3 "
        "new chunks",
        lapsed_lease,
    ),
    "checksum-mismatch": (
        "one loaded chunk's bytes are overwritten (verify_loads); the step completes 3 new chunks",
        checksum_mismatch,
    ),
    "copy-exception": (
        "the worker's copy raises mid-load; the step completes 3 new chunks",
        copy_exception,
    ),
    "missing-segment": (
        "the pool's shared-memory file disappears while the store runs",
        missing_segment,
    ),
    "store-killed-mid-load": (
        "the store is SIGKILLed between lookup and load",
        store_killed_mid_load,
    ),
    "weights-changed-in-place": (
        "other weights saved over the same model path, same store",
        weights_changed_in_place,
    ),
    "rope-override": (
        "same weights, other rope_theta (hf_overrides), same store",
        rope_override,
    ),
    "salt-with-newline": (
        "a cache_salt with a line break and non-ASCII; another salt must not hit it",
        salt_with_newline,
    ),
    "store-down-new-salt": (
        "the store is dead when a request brings a salt never seen",
        store_down_new_salt,
    ),
    "pool-too-small": ("a pool smaller than one chunk", pool_too_small),
    "store-hung": (
        "the store stops answering (SIGSTOP) while every request arrives at once",
        store_hung,
    ),
    "concurrent-failed-loads": (
        "every request in flight at once (shared prefixes, 32 tokens each, preempted by a small "
        "KV cache) while every load's second chunk fails its checksum",
        concurrent_failed_loads,
    ),
    "pool-full-pinned": (
        "every page of the pool held by another client's uncommitted writes",
        pool_full_pinned,
    ),
    **DISK_DRILLS,
}
