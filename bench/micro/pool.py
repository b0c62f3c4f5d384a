"""Put/get throughput of the DRAM pool beside memcpy, and the control API's per-chunk cost.

    kvtier bench pool [--mode process|embedded] [--sizes 64KiB,1MiB,16MiB]

For each chunk size the same bytes (``--total`` per round, spread over distinct source buffers,
so the working set is larger than the CPU caches) are:
- copied with a plain memcpy into a private destination (the floor);
- put into the pool through a store (allocate -> copy -> commit, ``--batch-bytes`` per control
  call; ``CpuTier.put_stream`` overlaps the next allocation and the last commit with the copy;
  the store checksums committed chunks afterwards, off the writer's path);
- read back the same way (lookup + lease -> copy out -> release, ``get_stream_into``).
Best of ``--repeat`` rounds, each with fresh keys. ``process`` mode talks to a real
``kvtier store serve`` process over gRPC (what vLLM workers do); ``embedded`` calls in-process.

The control calls are timed over each transport the store serves in the same run: TCP on
loopback and the node's Unix socket (how engines reach their store: no token, no network).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api import StoreAdmin
from kvtier.store.client.shm import page_aligned_empty
from kvtier.testing.services import start_store
from kvtier.tiers import connect
from kvtier.tiers.cpu import CpuTier

DEFAULT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


@dataclass
class ThroughputRow:
    chunk_bytes: int
    chunks: int
    batch: int
    memcpy_gbs: float
    put_gbs: float
    get_gbs: float

    @property
    def put_ratio(self) -> float:
        return self.put_gbs / self.memcpy_gbs

    @property
    def get_ratio(self) -> float:
        return self.get_gbs / self.memcpy_gbs


@dataclass
class ControlRow:
    transport: str
    op: str
    batch: int
    call_us: float
    per_chunk_us: float


@contextlib.contextmanager
def open_tier(mode: str, capacity: int, run_dir: Path) -> Iterator[tuple[CpuTier, dict[str, str]]]:
    """The tier, and the store's control addresses by transport (none when embedded)."""
    if mode == "embedded":
        config = StoreConfig(run_dir=run_dir, pool={"capacity": capacity})
        with connect(config) as tier:
            yield tier, {}
        return
    socket = run_dir / "sock" / "store.sock"
    extra = ("--unix-socket", str(socket))
    store = start_store(run_dir, str(capacity), "bench-pool", remote=False, extra=extra)
    try:
        with connect(StoreConfig(address=store.address)) as tier:
            yield tier, {"tcp": store.address, "unix": f"unix:{socket}"}
    finally:
        store.stop()


def _namespace(chunk_bytes: int, tag: str) -> Namespace:
    return Namespace(
        model=f"bench-{tag}",
        dtype="uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=chunk_bytes,
        chunk_tokens=16,
    )


def _keys(ns: Namespace, n: int, round_: int) -> list[bytes]:
    base = (round_ * 1_000_003) % (1 << 31)
    return prompt_keys(ns, np.arange(base, base + n * ns.chunk_tokens, dtype=np.uint32))


def measure_throughput(
    tier: CpuTier,
    size: int,
    total: int,
    batch_bytes: int,
    repeat: int,
    progress: tqdm | None = None,
) -> ThroughputRow:
    n = max(1, total // size)
    batch = max(1, min(n, batch_bytes // size))
    ns = _namespace(size, "tp")
    ns_id = tier.register_namespace(ns, size)
    rng = np.random.default_rng(size)
    # Page-aligned buffers, like vLLM's KV tensors (see page_aligned_empty on 4K aliasing).
    src_all = page_aligned_empty(n * size)
    src_all[:] = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    src = [src_all[i * size : (i + 1) * size] for i in range(n)]
    dst_all = page_aligned_empty(n * size)
    dst = [dst_all[i * size : (i + 1) * size] for i in range(n)]
    best = {"memcpy": float("inf"), "put": float("inf"), "get": float("inf")}
    for r in range(repeat):
        start = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i], src[i])
        best["memcpy"] = min(best["memcpy"], time.perf_counter() - start)

        keys = _keys(ns, n, r)
        _admin(tier).clear()  # each round starts from an empty pool: no eviction in the timing
        start = time.perf_counter()
        result = tier.put_stream(ns_id, keys, src, batch * size)
        assert result.stored == n, result
        best["put"] = min(best["put"], time.perf_counter() - start)

        start = time.perf_counter()
        copied = tier.get_stream_into(ns_id, keys, dst, batch * size)
        assert copied == n, copied
        best["get"] = min(best["get"], time.perf_counter() - start)
        if progress is not None:
            progress.update(1)
    if not all(np.array_equal(dst[i], src[i]) for i in range(0, n, max(1, n // 8))):
        raise AssertionError("pool returned different bytes")
    _admin(tier).clear()
    gbs = {k: n * size / v / 1e9 for k, v in best.items()}
    return ThroughputRow(size, n, batch, gbs["memcpy"], gbs["put"], gbs["get"])


def _admin(tier: CpuTier) -> StoreAdmin:
    """The store's admin surface: the benchmark owns the store it measures (embedded, or a
    process it started), and empties it between rounds."""
    store = tier.store
    assert isinstance(store, StoreAdmin)
    return store


def measure_control(
    tier: CpuTier, batches: list[int], transport: str, rounds: int = 50
) -> list[ControlRow]:
    """Latency of the batch control calls alone (no bytes copied): what one request's
    hundreds of chunks cost in round trips."""
    size = 64 << 10
    ns = _namespace(size, "ctl")
    ns_id = tier.register_namespace(ns, size)
    store = tier.store
    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {"allocate+commit": [], "lookup+lease+release": []}
        for r in range(rounds):
            keys = _keys(ns, batch, r + 100 * batch)
            start = time.perf_counter()
            result = store.allocate(ns_id, keys, [size] * batch)
            store.commit(result.lease_id, None, [1] * batch)
            times["allocate+commit"].append(time.perf_counter() - start)
            start = time.perf_counter()
            got = store.lookup(ns_id, keys, 30.0)
            store.release([got.lease_id])
            times["lookup+lease+release"].append(time.perf_counter() - start)
        for op, samples in times.items():
            median = float(np.median(samples))
            rows.append(ControlRow(transport, op, batch, median * 1e6, median * 1e6 / batch))
        _admin(tier).clear()
    return rows


def run(
    mode: str = "process",
    sizes: list[int] | None = None,
    total: int = 256 << 20,
    batch_bytes: int = 64 << 20,
    repeat: int = 3,
    control_batches: list[int] | None = None,
) -> dict:
    """``batch_bytes``: bytes per control call, i.e. one request's chunks (a 16k-token prompt
    of a 4 KiB/token model is 64 MiB)."""
    sizes = sizes or DEFAULT_SIZES
    control_batches = control_batches or [1, 8, 64, 512]
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp,
        open_tier(mode, 2 * total + (64 << 20), Path(tmp)) as (tier, addresses),
    ):
        with tqdm(total=len(sizes) * repeat, desc="throughput", unit="round") as bar:
            rows = [measure_throughput(tier, s, total, batch_bytes, repeat, bar) for s in sizes]
        control = [] if addresses else measure_control(tier, control_batches, "in-process")
        for (
            transport,
            address,
        ) in addresses.items():  # same store, same run: only the socket differs
            with connect(StoreConfig(address=address)) as client:
                control += measure_control(client, control_batches, transport)
    return {
        "mode": mode,
        "total_bytes": total,
        "batch_bytes": batch_bytes,
        "throughput": [
            asdict(r) | {"put_ratio": r.put_ratio, "get_ratio": r.get_ratio} for r in rows
        ],
        "control": [asdict(c) for c in control],
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    out = console()
    table = Table(title=f"DRAM pool vs memcpy ({report['mode']} store, best of rounds)")
    for col in (
        "chunk",
        "chunks",
        "memcpy GB/s",
        "put GB/s",
        "put/memcpy",
        "get GB/s",
        "get/memcpy",
    ):
        table.add_column(col, justify="right")
    for row in report["throughput"]:
        table.add_row(
            _size(row["chunk_bytes"]),
            str(row["chunks"]),
            f"{row['memcpy_gbs']:.2f}",
            f"{row['put_gbs']:.2f}",
            f"{row['put_ratio']:.0%}",
            f"{row['get_gbs']:.2f}",
            f"{row['get_ratio']:.0%}",
        )
    out.print(table)
    table = Table(title="control API: median latency per batch call (no data copied)")
    for col in ("transport", "operation", "chunks/call", "µs/call", "µs/chunk"):
        table.add_column(col, justify="right")
    for row in report["control"]:
        table.add_row(
            row["transport"],
            row["op"],
            str(row["batch"]),
            f"{row['call_us']:.0f}",
            f"{row['per_chunk_us']:.2f}",
        )
    out.print(table)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
