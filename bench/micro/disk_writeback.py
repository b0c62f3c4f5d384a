"""The disk tier's write-back at a pool's real turnover: what share of the chunks eviction
takes had a copy on disk already, as the rate of new KV rises past the disk's bandwidth
(docs/disk.md, "The write-back knee"):

    kvtier bench disk-writeback [--dir PATH] [--pools 512MiB,2GiB] [--rates 0.25,0.5,1,2]

The knee run of the disk tier (``kvtier bench knee --disk``) is a toy: its 1 MiB pool turns
over in milliseconds, faster than one write-back round (``store.disk.interval_s``), which is
not what a pool of tens of GB does. Here a real ``kvtier store serve`` process with the disk
tier on ``--dir`` takes new chunks (allocate, copy, commit over gRPC, ``CpuTier.put_stream``:
what vLLM's saves do) at a fixed rate for ``--seconds``, after the pool first filled, and the
store's own counters say what eviction took (``evictions``) and how much of it had no copy on
disk yet (``dirty_evictions``: lost to the disk tier). Rates are multiples of the disk's
write floor measured in the same run (one file of ``--floor-bytes`` written and fsynced),
so the table reads the same on any disk; pools of several sizes show where the cold end of
the pool (``1 - high_watermark`` of it, what a round copies from) turns over faster than a
round. Each (pool, rate, mode) runs on a fresh store process and an empty directory, the
modes interleaved (write-back, the default, and write-through).

The floor is a sustained write (several seconds of fsynced writes), not a burst: a device's
write cache takes a burst at several times what it sustains. The dimensionless numbers that
carry to production: rate ÷ disk bandwidth (coverage cannot exceed its inverse) and the cold
end's turnover time ``(1 - high_watermark) * pool / rate`` against ``interval_s``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api import StoreAdmin
from kvtier.store.client.shm import page_aligned_empty
from kvtier.testing.services import disk_env, start_store
from kvtier.tiers import connect

MODES = ("write-back", "write-through")
HIGH_WATERMARK = 0.75  # the store's default (store.disk.high_watermark)
WARMUP_S = 2.0  # at the rate, after the pool filled, before counting (at least; see measure)


@dataclass
class WritebackRow:
    mode: str
    pool_bytes: int
    target_gbs: float  # the rate asked for
    rate_gbs: float  # the rate the writer reached over the measured window
    rate_x_disk: float  # rate ÷ the disk's write floor
    cold_turnover_s: float  # (1 - high_watermark) * pool / rate
    evictions: int
    dirty_evictions: int
    spilled_gb: float

    @property
    def coverage(self) -> float:
        """Share of evicted chunks that had a copy on disk (1.0 when nothing was evicted)."""
        return 1.0 - self.dirty_evictions / self.evictions if self.evictions else 1.0


def disk_floor(directory: Path, seconds: float = 4.0, piece: int = 64 << 20) -> float:
    """GB/s the filesystem sustains: ``piece``-byte writes, each fsynced, into one file for
    ``seconds`` (a short burst measures the device's write cache, not what a write-back
    that runs for minutes gets: on the virtio disk here 1.3-1.5 GB/s for 512 MiB, ~0.7
    sustained)."""
    data = np.random.default_rng(0).integers(0, 256, piece, dtype=np.uint8)
    path = directory / "floor.bin"
    written = 0
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while time.perf_counter() - start < seconds:
            view = memoryview(data.data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            written += piece
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return written / elapsed / 1e9


def _namespace(chunk_bytes: int) -> Namespace:
    return Namespace(
        model="bench-writeback",
        dtype="uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=chunk_bytes,
        chunk_tokens=16,
    )


def measure(
    directory: Path,
    mode: str,
    pool_bytes: int,
    rate_gbs: float,
    disk_gbs: float,
    chunk_bytes: int,
    seconds: float,
    batch_chunks: int,
    warmup_s: float = WARMUP_S,
) -> WritebackRow:
    """One fresh store with the disk tier on ``directory``; fill its pool once, then put new
    chunks at ``rate_gbs`` for ``seconds`` and count what eviction took meanwhile."""
    disk_dir = directory / "disk"
    shutil.rmtree(disk_dir, ignore_errors=True)
    env = disk_env(
        disk_dir,
        KVTIER_STORE__DISK__CAPACITY=str(64 * pool_bytes),  # never the bound here
        KVTIER_STORE__DISK__WRITE_THROUGH="true" if mode == "write-through" else "false",
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-wb-") as run_dir:
        store = start_store(Path(run_dir), str(pool_bytes), "bench-wb", remote=False, env=env)
        try:
            with connect(StoreConfig(address=store.address)) as tier:
                admin = tier.store
                assert isinstance(admin, StoreAdmin)
                ns = _namespace(chunk_bytes)
                ns_id = tier.register_namespace(ns, chunk_bytes)
                source = page_aligned_empty(batch_chunks * chunk_bytes)
                source[:] = np.random.default_rng(1).integers(0, 256, source.size, dtype=np.uint8)
                views = [
                    source[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(batch_chunks)
                ]
                batch = 0

                def put_batch() -> None:
                    nonlocal batch
                    base = batch * batch_chunks * ns.chunk_tokens
                    tokens = np.arange(base, base + batch_chunks * ns.chunk_tokens)
                    keys = prompt_keys(ns, tokens.astype(np.uint32))
                    tier.put_stream(ns_id, keys, views, batch_chunks * chunk_bytes)
                    batch += 1

                def paced(duration: float) -> tuple[int, float]:
                    """Batches at ``rate_gbs`` for ``duration`` s: (bytes sent, seconds)."""
                    start = time.perf_counter()
                    sent = 0
                    while (elapsed := time.perf_counter() - start) < duration:
                        due = rate_gbs * 1e9 * elapsed
                        if sent > due:  # ahead of the rate: wait for it
                            time.sleep(min(0.01, (sent - due) / (rate_gbs * 1e9)))
                            continue
                        put_batch()
                        sent += batch_chunks * chunk_bytes
                    return sent, time.perf_counter() - start

                # fill the pool once, at full speed, then settle at the rate (the write-back
                # catches up with the fill's burst) before counting
                for _ in range(-(-pool_bytes // (batch_chunks * chunk_bytes)) + 1):
                    put_batch()
                # the fill left up to a pool of chunks to copy (write-through: all of it):
                # the warm-up lasts until the disk could have written them
                paced(max(warmup_s, pool_bytes / (disk_gbs * 1e9)) if warmup_s else 0.0)
                before = admin.stats()
                sent, elapsed = paced(seconds)
                after = admin.stats()
        finally:
            store.stop()
    rate = sent / elapsed / 1e9

    def delta(name: str) -> int:
        return int(after.get(name, 0)) - int(before.get(name, 0))

    return WritebackRow(
        mode=mode,
        pool_bytes=pool_bytes,
        target_gbs=rate_gbs,
        rate_gbs=rate,
        rate_x_disk=rate / disk_gbs,
        cold_turnover_s=(1 - HIGH_WATERMARK) * pool_bytes / (rate * 1e9),
        evictions=delta("evictions"),
        dirty_evictions=delta("dirty_evictions"),
        spilled_gb=delta("disk_spilled_bytes") / 1e9,
    )


def run(
    directory: Path,
    pools: list[int],
    rates: list[float],
    chunk_bytes: int = 2 << 20,
    seconds: float = 8.0,
    batch_bytes: int = 32 << 20,
    floor_seconds: float = 4.0,
    warmup_s: float = WARMUP_S,
) -> dict:
    """``rates``: multiples of the disk's write floor."""
    directory.mkdir(parents=True, exist_ok=True)
    disk_gbs = disk_floor(directory, floor_seconds)
    batch_chunks = max(1, batch_bytes // chunk_bytes)
    rows: list[WritebackRow] = []
    cases = [(p, r, m) for p in pools for r in rates for m in MODES]  # modes interleaved
    for pool, multiple, mode in tqdm(cases, desc="disk write-back", unit="run"):
        row = measure(
            directory,
            mode,
            pool,
            multiple * disk_gbs,
            disk_gbs,
            chunk_bytes,
            seconds,
            batch_chunks,
            warmup_s,
        )
        rows.append(row)
    disk_after = disk_floor(directory, floor_seconds)  # the same disk after every run
    shutil.rmtree(directory / "disk", ignore_errors=True)
    return {
        "directory": str(directory),
        "disk_write_gbs": disk_gbs,
        "disk_write_after_gbs": disk_after,
        "chunk_bytes": chunk_bytes,
        "seconds": seconds,
        "rows": [asdict(r) | {"coverage": r.coverage} for r in rows],
    }


def format_report(report: dict) -> str:
    lines = [
        f"disk write floor (one file in {report['directory']}, 64 MiB writes each fsynced, "
        f"sustained): {report['disk_write_gbs']:.2f} GB/s before the runs, "
        f"{report['disk_write_after_gbs']:.2f} after; chunks of {report['chunk_bytes'] >> 20} MiB, "
        f"{report['seconds']:.0f} s per run after the pool filled",
        "",
        "| pool | mode | rate GB/s | rate ÷ disk | cold end turns over in | evicted | "
        "without a disk copy | **on disk when evicted** | written GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['pool_bytes'] >> 20} MiB | {r['mode']} | {r['rate_gbs']:.2f} | "
            f"{r['rate_x_disk']:.2f} | {r['cold_turnover_s'] * 1e3:.0f} ms | {r['evictions']} | "
            f"{r['dirty_evictions']} | **{r['coverage']:.1%}** | "
            f"{r['spilled_gb'] / report['seconds']:.2f} |"
        )
    return "\n".join(lines)


def plot(reports: list[dict], path: Path) -> None:
    """Share of evicted chunks on disk against the rate of new KV: a line per pool and mode,
    every report's rows together (runs on one disk), the tier's own write rate beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for report in reports:
        for r in report["rows"]:
            lines.setdefault((r["pool_bytes"], r["mode"]), []).append(
                (r["rate_gbs"], r["coverage"])
            )
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for (pool, mode), points in sorted(lines.items()):
        points.sort()
        ax.plot(
            [x for x, _ in points],
            [100 * y for _, y in points],
            marker="o" if mode == "write-back" else "x",
            linestyle="-" if mode == "write-back" else "--",
            label=f"{pool >> 20} MiB pool, {mode}",
        )
    wrote = max(r["spilled_gb"] / rep["seconds"] for rep in reports for r in rep["rows"])
    ax.axvline(wrote, color="black", linestyle=":", linewidth=1)
    ax.text(wrote, 5, f" the tier wrote at most {wrote:.2f} GB/s", fontsize=8)
    ax.set_xlabel("new KV into the pool, GB/s")
    ax.set_ylabel("evicted chunks with a copy on disk, %")
    ax.set_ylim(0, 105)
    ax.set_title("disk tier write-back: what eviction takes is already on disk")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
