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

from kvtier.bench.engine.tier_latency import Report, _collect, _moved_per_token, last_error
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
        phases, labels = _disk_phases(prompts, warmup, suffixes, "disk")
        spec = {**spec_base, "phases": phases, "kv_transfer_config": kvtier_transfer_config(extra)}
        progress(f"kvtier-disk: {len(prompts)} prompts x miss, gpu, then disk")
        results = run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)), timeout=7200)
        _collect(report, "kvtier-disk", results, labels)
        if not report.moved_bytes_per_token:  # the floor: the bytes a hit actually moved
            report.moved_bytes_per_token = _moved_per_token(results[-1])
        report.disk_floors = disk_floors(disk, report)
    finally:
        store.stop()


def _disk_phases(
    prompts: dict, warmup: list[int], suffixes: dict[str, list[int]], tier: str
) -> tuple[list[dict], list[tuple[str, int] | None]]:
    """Each prompt computed and hit on the GPU, its saves settled (copied to disk) before the
    next prompt's evict it from DRAM; then each sent again after vLLM's cache is reset: from
    the tier below DRAM (``tier``), or from DRAM for the last ones still there."""
    warm = {"op": "generate", "prompts": [warmup], "max_tokens": 1}
    phases: list[dict] = [warm, warm]
    labels: list[tuple[str, int] | None] = [None, None]
    for (length, _), prompt in prompts.items():
        for kind in ("miss", "gpu"):
            request = prompt + suffixes[kind]
            phases.append({"op": "generate", "prompts": [request], "max_tokens": 1})
            labels.append((kind, length))
        phases += [{"op": "settle"}, {"op": "sleep", "seconds": 0.5}]
        labels += [None, None]
    for (length, _), prompt in prompts.items():
        phases.append({"op": "reset_prefix_cache"})
        phases.append({"op": "generate", "prompts": [prompt + suffixes["disk"]], "max_tokens": 1})
        labels += [None, (tier, length)]
    phases.append({"op": "metrics"})
    labels.append(None)
    return phases, labels


def run_lmcache_disk(
    report: Report,
    prompts: dict,
    warmup: list[int],
    suffixes: dict[str, list[int]],
    spec_base: dict,
    tmp: Path,
    pool_bytes: int,
    progress: Callable[[str], None],
) -> None:
    """The same phases with LMCache 0.5 (``lmcache server`` + ``LMCacheMPConnector``): an L1
    the size of kvtier-disk's pool and its native filesystem L2 (``fs_native``) on the same
    filesystem. vLLM labels LMCache's hits ``external_unspecified`` whichever of its tiers
    served them; the L1 holds about two of the longest prompts, so the earlier ones come
    back from its L2 (the report says how many files its L2 held)."""
    from kvtier.bench.peers.lmcache import PRELOAD, LMCacheServer

    l2 = tmp / "lmcache-l2"
    l2.mkdir(parents=True, exist_ok=True)
    server = LMCacheServer(tmp / "lmcache-disk.log", l1_gb=pool_bytes / 1e9, l2_disk=l2)
    server.start()
    try:
        phases, labels = _disk_phases(prompts, warmup, suffixes, "l2")
        spec = {
            **spec_base,
            "phases": phases,
            "kv_transfer_config": server.kv_transfer_config(),
            "preload": [PRELOAD],
        }
        progress(f"lmcache-disk: {len(prompts)} prompts x miss, gpu, then its L2")
        try:
            results = run_vllm(spec, vllm_env(), timeout=7200)
        except RuntimeError as exc:
            report.failures["lmcache-disk"] = last_error(str(exc))
            return
        _collect(report, "lmcache-disk", results, labels)
        files = [p for p in l2.rglob("*") if p.is_file()]
        report.notes.append(
            f"lmcache-disk: its L2 held {len(files)} files, "
            f"{sum(p.stat().st_size for p in files) >> 20} MiB"
        )
    finally:
        server.stop()


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
