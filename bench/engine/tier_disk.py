"""``kvtier bench tier-latency --configs kvtier-disk``: a disk hit's TTFT, and the filesystem's
floor for the same bytes (docs/disk.md).

A node store with the disk tier (write-through, every file fsynced) and a pool that holds
about two prompts of the longest length: each prompt is computed and hit on the GPU, then
every prompt is sent again after vLLM's cache is reset, most of them long evicted from DRAM,
staged from disk. The floor: one file of the prompt's KV bytes written with fsync and read
back with the page cache dropped, on the same filesystem, best of 3.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtier.bench.engine.tier_latency import Report, _collect, _moved_per_token
from kvtier.store.client.shm import page_aligned_empty
from kvtier.testing.models import vllm_env
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm


def run_disk(
    report: Report,
    prompts: dict,
    warmup: list[int],
    suffixes: dict[str, list[int]],
    spec_base: dict,
    tmp: Path,
    pool_bytes: int,
    progress: Callable[[str], None],
) -> None:
    """A node store with the disk tier (write-through, every file fsynced) and a pool that
    holds about one prompt of the longest length: each prompt is computed (saved to the pool
    and copied to disk) and hit on the GPU; then every prompt is sent again after vLLM's cache
    is reset, most of them long evicted from DRAM: staged from disk into the pool and loaded.
    A prompt still in DRAM lands there, is seen in vLLM's counters and left out."""
    from kvtier.testing.services import disk_env, start_store

    run_dir, disk = tmp / "disk-run", tmp / "disk"
    # a small pool: one prompt's saves fill it
    env = disk_env(disk, KVTIER_STORE__DISK__CAPACITY="64GiB", KVTIER_STORE__MAX_BATCH_FRACTION="1")
    store = start_store(run_dir, str(pool_bytes), "node-disk", remote=False, env=env)
    try:
        extra = {
            "store_address": store.address,
            "tiers": ["cpu", "disk"],
            "disk_timeout_s": 60.0,
            "lookup_deadline_s": 90.0,  # a stage is given its whole timeout
            "min_hit_tokens": {"cpu": 256, "disk": 256},
        }
        warm = {"op": "generate", "prompts": [warmup], "max_tokens": 1}
        phases: list[dict] = [warm, warm]
        labels: list[tuple[str, int] | None] = [None, None]
        for (length, _), prompt in prompts.items():
            for tier in ("miss", "gpu"):
                request = prompt + suffixes[tier]
                phases.append({"op": "generate", "prompts": [request], "max_tokens": 1})
                labels.append((tier, length))
            # every chunk on disk before the next prompt's saves evict it from DRAM
            phases += [{"op": "settle"}, {"op": "sleep", "seconds": 0.5}]
            labels += [None, None]
        for (length, _), prompt in prompts.items():
            phases.append({"op": "reset_prefix_cache"})
            phases.append(
                {"op": "generate", "prompts": [prompt + suffixes["disk"]], "max_tokens": 1}
            )
            labels += [None, ("disk", length)]
        phases.append({"op": "metrics"})
        labels.append(None)
        spec = {**spec_base, "phases": phases, "kv_transfer_config": kvtier_transfer_config(extra)}
        progress(f"kvtier-disk: {len(prompts)} prompts x miss, gpu, then disk")
        results = run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)), timeout=7200)
        _collect(report, "kvtier-disk", results, labels)
        if not report.moved_bytes_per_token:  # the floor: the bytes a hit actually moved
            report.moved_bytes_per_token = _moved_per_token(results[-1])
        report.disk_floors = disk_floors(disk, report)
    finally:
        store.stop()


def disk_floors(directory: Path, report: Report) -> dict[int, tuple[float, float]]:
    """Per length: seconds to write (fsynced) and to read back (page cache dropped first) one
    file of that prompt's KV bytes on the disk tier's filesystem, best of 3: the floor a
    disk hit's staging is compared with."""
    per_token = report.moved_bytes_per_token or report.kv_bytes_per_token
    out: dict[int, tuple[float, float]] = {}
    path = directory / "floor.bin"
    for length in report.lengths:
        data = np.random.default_rng(length).integers(0, 256, length * per_token, np.uint8)
        buf = page_aligned_empty(data.nbytes)
        best_w = best_r = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, data.data)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            best_w = min(best_w, time.perf_counter() - start)
            start = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            os.preadv(fd, [buf.data], 0)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            best_r = min(best_r, time.perf_counter() - start)
        out[length] = (best_w, best_r)
    path.unlink(missing_ok=True)
    return out
