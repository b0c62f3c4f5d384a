"""The disk tier's fault drills (``kvtier bench faults``; docs/disk.md, "Failures").

Each runs a node store with the disk tier (write-through: every chunk copied to disk within
~50 ms) and a 1 MiB pool that the drill overflows, so prompts come back from disk:

- ``disk-bad-files``: A is stored (and copied to disk), filler prompts evict it from DRAM,
  every chunk file but each B prompt's first is damaged, then every B (A's first 256 tokens +
  200 new ones) is in flight at once: each stage loads its first chunk and stops at the
  next, the rest recomputes, and the step that recomputes also saves B's new chunks. A fresh
  pass then reads back whatever was saved.
- ``disk-store-killed``: A is stored and copied to disk, the store is SIGKILLed and another
  started on the same directory; a new instance's B (all in flight) and A hit from disk.
- ``disk-io-errors``: the store's chunk-file calls fail on demand (``testing.disk_faults``:
  ENOSPC, EIO, a read-only filesystem, nothing else makes them on demand): a group of prompts
  stored under each write error and evicted, one group copied to disk and evicted, then every
  read fails with EIO while all the groups come back. All recompute, exactly.

Every output is compared with the reference, bit for bit (``run.tally``).
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

from kvtier.bench.faults.run import DrillContext, DrillResult, add_counters, generate, tally
from kvtier.testing.services import Service, disk_env, start_store, store_stats

RESET = {"op": "reset_prefix_cache"}
SETTLE = {"op": "settle"}
METRICS = {"op": "metrics"}
COPIED = {"op": "sleep", "seconds": 0.5}  # the store's spill thread copies within ~50 ms
POOL = "1MiB"  # 32 chunks of the drill model (64 tokens x 512 B): the filler overflows it
FILLER = (6, 512)  # prompts x tokens: 48 chunks


def _disk_store(ctx: DrillContext, disk: Path) -> Service:
    # a 1 MiB pool: one step's saves may fill it
    env = disk_env(disk, KVTIER_STORE__MAX_BATCH_FRACTION="1")
    return start_store(ctx.run_dir, POOL, "drill-disk", remote=False, env=env)


def _config(ctx: DrillContext, store: Service) -> dict:
    return {
        # chunk keys independent of the scratch path (what the drills' runs share)
        "model_id": "disk-drill",
        "store_address": store.address,
        "tiers": ["cpu", "disk"],
        "min_hit_tokens": {"cpu": ctx.chunk, "disk": ctx.chunk},
    }


def _filler(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(FILLER[1])] for _ in range(FILLER[0])]


def _fresh_dir(ctx: DrillContext, name: str) -> Path:
    disk = ctx.workdir / name
    shutil.rmtree(disk, ignore_errors=True)
    return disk


def disk_bad_files(ctx: DrillContext) -> DrillResult:
    result = DrillResult("", "")
    prompts = ctx.prompts(31)
    disk = _fresh_dir(ctx, "disk-bad-files")
    store = _disk_store(ctx, disk)
    many = {"batch": True}
    try:
        phases = [generate(prompts.a), SETTLE, COPIED, generate(_filler(32)), SETTLE, COPIED]
        # every file but each B prompt's first chunk: its stage loads that one and stops at
        # the next, whatever order the keys (they change with the model's path) put them in
        damage = {"op": "damage_files", "dir": str(disk), "spare_first_of": prompts.b}
        phases += [damage, RESET]
        phases += [generate(prompts.b) | many, SETTLE, COPIED, RESET]
        phases += [generate(prompts.b) | many, RESET, generate(prompts.a), METRICS]
        out = ctx.vllm(phases, _config(ctx, store))
        reference = ctx.reference(prompts.a + prompts.b)
        tally(result, out[0], prompts.a, reference)
        tally(result, out[8], prompts.b, reference, timed=True, batched=True)
        tally(result, out[12], prompts.b, reference, batched=True)
        tally(result, out[14], prompts.a, reference)
        add_counters(result, out[-1])
        result.notes.append(f"{out[6]} files damaged")
        result.counters["damaged_files"] = out[6]
    finally:
        store.stop()
    return result


def disk_store_killed(ctx: DrillContext) -> DrillResult:
    result = DrillResult("", "")
    prompts = ctx.prompts(33)
    disk = _fresh_dir(ctx, "disk-store-killed")
    store = _disk_store(ctx, disk)
    try:
        kill = {"op": "signal", "pid": store.pid, "signal": "SIGKILL"}
        first = ctx.vllm([generate(prompts.a), SETTLE, COPIED, kill], _config(ctx, store))
    finally:
        store.stop()
    again = _disk_store(ctx, disk)
    try:
        phases = [generate(prompts.b) | {"batch": True}, RESET, generate(prompts.a), METRICS]
        out = ctx.vllm(phases, _config(ctx, again))
        reference = ctx.reference(prompts.a + prompts.b)
        tally(result, first[0], prompts.a, reference)
        tally(result, out[0], prompts.b, reference, timed=True, batched=True)
        tally(result, out[2], prompts.a, reference)
        add_counters(result, out[-1])
    finally:
        again.stop()
    return result


def disk_io_errors(ctx: DrillContext) -> DrillResult:
    """The store's chunk-file I/O fails (``testing.disk_faults``: the one fake here): writes
    with ENOSPC, then EIO, then a read-only filesystem, each while a group of prompts is
    stored and evicted (none reaches the disk); then, writes healthy, a group is copied to
    disk and evicted from DRAM, and every read fails with EIO while all the groups come back.
    Every answer exact, the store serving throughout, no temporary file left.

    The last phase runs the requests one after the other: all of them recompute whole
    prompts, and 400 whole prefills in flight at once (``--requests 100``) gave 7 first
    positions rounded differently from the one-at-a-time reference (by ~1e-6, with no cache
    involved: vLLM's CPU kernels are not batch-invariant). Concurrent stages against bad
    files are ``disk-bad-files``'s."""
    result = DrillResult("", "")
    groups = [ctx.prompts(seed).a for seed in (35, 36, 37, 38)]
    disk = _fresh_dir(ctx, "disk-io-errors")
    control = ctx.workdir / "disk-io-errors.fault"
    control.unlink(missing_ok=True)
    wrapper = (sys.executable, "-m", "kvtier.testing.disk_faults", str(control), "--")
    env = disk_env(disk, KVTIER_STORE__MAX_BATCH_FRACTION="1")
    store = start_store(ctx.run_dir, POOL, "drill-disk", remote=False, env=env, wrapper=wrapper)
    phases: list[dict] = []
    answers: list[tuple[int, list[list[int]]]] = []

    def fault(text: str) -> None:
        phases.append({"op": "write_file", "path": str(control), "text": text})

    def ask(prompts: list[list[int]]) -> None:
        answers.append((len(phases), prompts))
        phases.append(generate(prompts))

    try:
        kinds = ("write ENOSPC", "write EIO", "write EROFS")
        for kind, group in zip(kinds, groups[:3], strict=True):
            fault(kind)
            ask(group)
            phases.extend([SETTLE, COPIED])
        phases.extend([generate(_filler(34)), SETTLE, COPIED])  # evicted, never copied
        fault("")
        ask(groups[3])  # copied to disk ...
        phases.extend([SETTLE, COPIED, generate(_filler(39)), SETTLE, COPIED])  # ... not in DRAM
        fault("read EIO")
        phases.append(RESET)
        ask([p for group in groups for p in group])
        phases.append(SETTLE)
        fault("")
        phases.append(METRICS)
        out = ctx.vllm(phases, _config(ctx, store))
        reference = ctx.reference([p for group in groups for p in group])
        for i, prompts in answers:
            tally(result, out[i], prompts, reference, timed=i == answers[-1][0])
        add_counters(result, out[-1])
        stats = store_stats(store.address, store.pid) or {}
        for name in ("disk_write_errors", "disk_read_errors", "disk_chunks"):
            result.counters[f"store_{name}"] = float(stats.get(name, 0))
        leftovers = [p for p in disk.rglob("*") if ".tmp-" in p.name]
        result.counters["temporary_files_left"] = float(len(leftovers))
        result.engine_crashes += int(store.proc.poll() is not None)  # the store served on
    finally:
        store.stop()
    return result


DISK_DRILLS = {
    "disk-bad-files": (
        "every chunk file on the node's disk damaged but each prompt's first, then every "
        "request in flight at once loads from disk; the recomputing step saves 3 new chunks",
        disk_bad_files,
    ),
    "disk-store-killed": (
        "the store is SIGKILLed with the prompts on its disk; another store on the same "
        "directory serves them to requests in flight at once",
        disk_store_killed,
    ),
    "disk-io-errors": (
        "the disk tier's writes fail (ENOSPC, EIO, read-only filesystem) while prompts are "
        "stored and evicted, then its reads (EIO) while they come back",
        disk_io_errors,
    ),
}
