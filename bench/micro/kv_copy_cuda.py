"""The worker's copy on CUDA: DRAM pool -> paged HBM and back, beside pinned cudaMemcpy.

    kvtier bench kv-copy --device cuda [--tokens 8192,32768] [--layers 32] [--kv-heads 8]
        [--head-size 128] [--case flash-attn] [--new-tokens 512]

A DRAM hit of ``tokens`` tokens loads every layer's pages of those tokens from the node's
pool (a shared-memory segment registered with CUDA) into the KV blocks vLLM allocated, in
the layout vLLM's attention backend gets (``kv_layouts``; bf16, 16-token blocks). Timed, each
the best of ``repeat`` after a warm-up, wall clock from issue to the stream's completion:
- floors: one ``cudaMemcpy`` of the same bytes each way between torch-pinned host memory
  (``cudaHostAlloc``) and the device, and the same from / into the registered pool;
- load and save through ``PagedKV`` (what the worker runs per job: plan, per-layer copies on
  the side streams), consecutive block ids (a fresh request) and scattered ones (a long-
  running engine's fragmented free list);
- layer-wise: a sync load through ``ConnectorWorker`` (the ``kvtier-load`` thread, per-layer
  events) while the compute stream replays, per layer, a CUDA graph of one transformer
  layer's work on ``new_tokens`` new tokens (Llama-3-8B-sized projections and MLP, attention
  over the cached context), beside that compute alone and the copy alone: how much of the
  copy the forward hides; and the same with ``verify_loads`` (the host checksums every
  loaded chunk's pool bytes after the copy), on the worker's ``verify_threads`` and on one.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.bench.micro import kv_layouts
from kvtier.bench.micro.kv_copy import whole_chunks
from kvtier.connector import cuda_copy
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy, KvtierMetadata, LoadJob, SegmentRef
from kvtier.connector.paged_kv import PagedKV, PoolView
from kvtier.connector.worker import ConnectorWorker
from kvtier.core.config.connector import ConnectorConfig
from kvtier.store.client.shm import SharedSegment, checksum_views


def _best(fn: Callable[[], object], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` runs after one warm-up, each from issue to the
    device's completion."""
    best = float("inf")
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


class LayerCompute:
    """One transformer layer's forward for ``new_tokens`` tokens over ``context`` cached
    tokens, captured once as a CUDA graph and replayed per layer (weights shared: the time is
    what matters). Llama-3-8B sizes: hidden = q_heads x head_size, MLP 3.5x hidden."""

    def __init__(self, new_tokens: int, context: int, kv_heads: int, head_size: int) -> None:
        q_heads = kv_heads * 4
        hidden = q_heads * head_size
        inter = hidden * 7 // 2

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")

        self.x = randn(new_tokens, hidden)
        self.w_qkv = randn(hidden, (q_heads + 2 * kv_heads) * head_size) * 0.01
        self.w_o = randn(hidden, hidden) * 0.01
        self.w_gate_up = randn(hidden, 2 * inter) * 0.01
        self.w_down = randn(inter, hidden) * 0.01
        self.k = randn(1, q_heads, context, head_size)
        self.v = randn(1, q_heads, context, head_size)
        self.shape = (new_tokens, q_heads, head_size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._layer()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._layer()

    def _layer(self) -> None:
        n, heads, size = self.shape
        qkv = self.x @ self.w_qkv
        q = qkv[:, : heads * size].reshape(n, heads, size).transpose(0, 1).unsqueeze(0)
        attn = torch.nn.functional.scaled_dot_product_attention(q, self.k, self.v)
        out = attn.squeeze(0).transpose(0, 1).reshape(n, heads * size) @ self.w_o
        gate, up = (out @ self.w_gate_up).chunk(2, dim=-1)
        self.x.copy_((torch.nn.functional.silu(gate) * up) @ self.w_down * 0.01 + self.x * 0.5)

    def __call__(self, layer: int) -> None:
        self.graph.replay()


H2D, D2H = "H2D floor: pinned cudaMemcpy", "D2H floor: pinned cudaMemcpy"
MEMCPY, TORCH_COPY = "cudaMemcpy", "cudaMemcpy via torch copy_"


def _floors(pool: PoolView, total: int, repeat: int, way: str) -> list[tuple[str, float, str]]:
    """One copy of the same bytes between torch-pinned host memory and the device, and
    between the registered pool and the device."""
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    src = pool.tensor[:total]
    if way == "H2D":
        return [
            (H2D, _best(lambda: device.copy_(host, non_blocking=True), repeat), H2D),
            (
                "H2D from the registered pool",
                _best(lambda: device.copy_(src, non_blocking=True), repeat),
                H2D,
            ),
        ]
    return [
        (D2H, _best(lambda: host.copy_(device, non_blocking=True), repeat), D2H),
        (
            "D2H into the registered pool",
            _best(lambda: src.copy_(device, non_blocking=True), repeat),
            D2H,
        ),
    ]


def _one_size(
    tokens: int,
    case: kv_layouts.CacheCase,
    chunk_tokens: int,
    new_tokens: int,
    repeat: int,
    kv_heads: int,
    head_size: int,
) -> dict:
    spec = case.groups[0].spec
    blocks = tokens // spec.block_size
    per_chunk = chunk_tokens // spec.block_size
    chunks = blocks // per_chunk
    num_blocks = 2 * blocks + 16  # room for scattered ids
    _, views = kv_layouts.allocate(case, num_blocks, "cuda")
    geo = KvGeometry(case.groups[0].layers, spec.block_size, spec.page_bytes, chunk_tokens, "b")
    total = chunks * geo.chunk_bytes
    name = f"kvtier-bench-kvcopy-cuda-{os.getpid()}-{tokens}"
    segment = SharedSegment.create(name, total)
    rows: list[tuple[str, float, str]] = []
    try:
        segment.array[:] = 7
        consecutive = list(range(8, 8 + blocks))
        scattered = random.Random(0).sample(range(num_blocks), blocks)

        def copies(ids: list[int]) -> list[ChunkCopy]:
            return whole_chunks(geo, ids)

        paged = PagedKV(views, geo)
        pool = PoolView(segment, pin=True)

        runtime, via_torch = paged.memcpy, cuda_copy.Memcpy(runtime=False)

        def use(path: str) -> None:
            paged.use_kernel = path == "copy kernel"
            paged.memcpy = via_torch if path == TORCH_COPY else runtime

        def load(ids: list[int], path: str) -> None:
            use(path)
            plan = paged.plan(copies(ids))
            paged.bind_compute()
            for layer in range(geo.num_layers):
                paged.load_layer(layer, pool, plan)
            paged.finish_loads()

        def save(ids: list[int], path: str) -> None:
            use(path)
            plan = paged.plan(copies(ids))
            for layer in range(geo.num_layers):
                paged.save_layer(layer, pool, plan)
            paged.finish_saves()

        def load_per_chunk(ids: list[int]) -> None:
            """The obvious torch calls, and kvtier's CUDA path before it was measured: per
            chunk and layer an upload, a pageable block-id tensor, ``index_copy_``."""
            with torch.cuda.stream(paged.ordering.load_stream):  # type: ignore[union-attr]
                for layer in range(geo.num_layers):
                    for chunk in copies(ids):
                        start = layer * geo.layer_bytes
                        src = pool.read(chunk.extents, start, per_chunk * geo.page_bytes)
                        src = src.view(per_chunk, geo.page_bytes).to("cuda", non_blocking=True)
                        index = torch.tensor(chunk.block_ids, device="cuda")
                        paged.rows[layer].index_copy_(0, index, src)
            paged.finish_loads()

        kernel = paged.kv_words is not None and pool.device_words is not None
        paths = ["copy kernel"] if kernel else []
        paths += [MEMCPY, TORCH_COPY] if runtime.cudart is not None else [TORCH_COPY]
        rows += _floors(pool, total, repeat, "H2D")
        for path in paths:
            for order, ids in (("consecutive", consecutive), ("scattered", scattered)):
                timed = _best(functools.partial(load, ids, path), repeat)
                rows.append((f"load, {order} blocks, {path}", timed, H2D))
        timed = _best(functools.partial(load_per_chunk, consecutive), repeat)
        rows.append(("load, per-chunk index_copy_ (before)", timed, H2D))
        rows += _floors(pool, total, repeat, "D2H")
        for path in paths:
            for order, ids in (("consecutive", consecutive), ("scattered", scattered)):
                timed = _best(functools.partial(save, ids, path), repeat)
                rows.append((f"save, {order} blocks, {path}", timed, D2H))
        pinned = pool.pinned
        pool.close()
        layer_wise = _layer_wise(
            segment,
            geo,
            views,
            copies(consecutive),
            new_tokens,
            tokens,
            repeat,
            kv_heads,
            head_size,
        )
    finally:
        segment.close()
        segment.unlink()
    floors = {what: s for what, s, _ in rows if what in (H2D, D2H)}
    return {
        "tokens": tokens,
        "bytes": total,
        "page_bytes": spec.page_bytes,
        "layers": geo.num_layers,
        "pool_registered": pinned,
        "rows": [
            {
                "what": what,
                "seconds": s,
                "gb_per_s": total / s / 1e9,
                "of_floor": floors[floor] / s,
            }
            for what, s, floor in rows
        ],
        "layer_wise": layer_wise,
    }


def _layer_wise(
    segment: SharedSegment,
    geo: KvGeometry,
    views: dict[str, torch.Tensor],
    chunks: list[ChunkCopy],
    new_tokens: int,
    context: int,
    repeat: int,
    kv_heads: int,
    head_size: int,
) -> dict:
    """The forward of ``new_tokens`` tokens while the connector loads the cached ``context``
    layer by layer, against each alone; interleaved, best of ``repeat`` each."""
    ref = SegmentRef(segment.name, segment.size, 1)
    worker = ConnectorWorker(ConnectorConfig(chunk_tokens=geo.chunk_tokens), geo, rank=0)
    worker.register_kv_caches(views)
    compute = LayerCompute(new_tokens, context, kv_heads, head_size)
    # distinct keys: the worker checks a key once (a chunk split over several copies)
    with_sums = [
        ChunkCopy(c.extents, checksum_views(segment.views(c.extents)), 0, c.block_ids, key)
        for key, c in ((i.to_bytes(16, "big"), c) for i, c in enumerate(chunks))
    ]
    parallel = worker.config
    serial = parallel.model_copy(update={"verify_threads": 1})

    def step(load: list[ChunkCopy] | None, forward: bool) -> None:
        jobs = (
            [LoadJob("bench", {0: ref}, {0: load}, False, bool(load[0].checksum))] if load else []
        )
        meta = KvtierMetadata(loads=jobs)
        worker.start_load_kv(meta)
        for layer, name in enumerate(geo.layer_names):
            worker.wait_for_layer_load(name)
            if forward:
                compute(layer)
        worker.save(meta)
        if worker.get_block_ids_with_load_errors():
            raise RuntimeError("a benchmark load failed")

    kv = worker.kv
    assert kv is not None
    default = kv.use_kernel
    kernel = kv.kv_words is not None

    def path(
        use_kernel: bool, fn: Callable[[], None], config: ConnectorConfig = parallel
    ) -> Callable[[], None]:
        def run() -> None:
            kv.use_kernel = use_kernel
            worker.config = config
            fn()

        return run

    runs = {
        "forward alone": path(default, lambda: step(None, True)),
        "load alone": path(default, lambda: step(chunks, False)),
        "load + forward": path(default, lambda: step(chunks, True)),
        "load + forward, verify_loads": path(default, lambda: step(with_sums, True)),
        "load + forward, verify_loads, 1 thread": path(
            default, lambda: step(with_sums, True), serial
        ),
    }
    if kernel:  # the other way: the copy kernel shares the SMs, the copy engine does not
        other = "cudaMemcpy" if default else "copy kernel"
        runs[f"load alone, {other}"] = path(not default, lambda: step(chunks, False))
        runs[f"load + forward, {other}"] = path(not default, lambda: step(chunks, True))
    best = {what: float("inf") for what in runs}
    for _ in range(repeat + 1):  # interleaved; the first round warms up
        for what, fn in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best[what] = min(best[what], time.perf_counter() - start)
    worker.shutdown()
    forward, load, both = best["forward alone"], best["load alone"], best["load + forward"]
    return {
        "new_tokens": new_tokens,
        "path": "copy kernel" if default else "cudaMemcpy",
        "seconds": best,
        "ideal": max(forward, load),
        "hidden_of_load": (forward + load - both) / load,
        "hideable_of_load": min(forward, load) / load,
    }


def run_cuda(
    tokens: list[int],
    layers: int = 32,
    kv_heads: int = 8,
    head_size: int = 128,
    case_name: str = "flash-attn",
    chunk_tokens: int = 256,
    new_tokens: int = 512,
    repeat: int = 5,
) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("kvtier bench kv-copy --device cuda needs a CUDA device")
    case = kv_layouts.case_named(case_name, layers=layers, kv_heads=kv_heads, head_size=head_size)
    spec = case.groups[0].spec
    sizes = [
        _one_size(n, case, chunk_tokens, new_tokens, repeat, kv_heads, head_size) for n in tokens
    ]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "case": case.name,
        "layout": case.layout,
        "chunk_tokens": chunk_tokens,
        "geometry": f"{layers} layers x {spec.num_heads} x {spec.content_bytes} B per token "
        f"({spec.dtype}), {spec.block_size}-token blocks, {chunk_tokens}-token chunks",
        "sizes": sizes,
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    out = console()
    for size in report["sizes"]:
        table = Table(
            title=f"{report['device']}: pool <-> paged HBM, {size['tokens']:,} tokens = "
            f"{size['bytes'] >> 20} MiB ({report['geometry']}, {report['layout']})"
        )
        for col in ("what", "ms", "GB/s", "of floor"):
            table.add_column(col, justify="right")
        for row in size["rows"]:
            table.add_row(
                row["what"],
                f"{row['seconds'] * 1e3:.2f}",
                f"{row['gb_per_s']:.1f}",
                f"{row['of_floor']:.0%}",
            )
        out.print(table)
        lw = size["layer_wise"]
        table = Table(
            title=f"layer-wise: loading {size['tokens']:,} cached tokens under a forward of "
            f"{lw['new_tokens']} new ones; {lw['hidden_of_load']:.0%} of the load hidden "
            f"(at most {lw['hideable_of_load']:.0%} can be)"
        )
        table.add_column("what", justify="right")
        table.add_column("ms", justify="right")
        for what, seconds in lw["seconds"].items():
            table.add_row(what, f"{seconds * 1e3:.2f}")
        table.add_row("ideal: max(forward, load)", f"{lw['ideal'] * 1e3:.2f}")
        out.print(table)


def plot(reports: list[dict], path: Path) -> None:
    """Each configuration's copies as a fraction of the pinned-cudaMemcpy floor: one group of
    bars per (case, chunk size, tokens), one bar per path and block order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[tuple[str, dict[str, float]]] = []
    for report in reports:
        for size in report["sizes"]:
            label = (
                f"{report['case']}\n{size['tokens'] // 1024}k tok, {report['chunk_tokens']}/chunk"
            )
            rows = {
                r["what"]: r["of_floor"]
                for r in size["rows"]
                if "floor" not in r["what"] and "registered pool" not in r["what"]
            }
            groups.append((label, rows))
    bars = [w for w in groups[0][1] if "(before)" not in w and TORCH_COPY not in w]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5.6))
    width = 0.8 / len(bars)
    for i, what in enumerate(bars):
        xs = [g + (i - len(bars) / 2 + 0.5) * width for g in range(len(groups))]
        ax.bar(xs, [rows.get(what, 0) for _, rows in groups], width, label=what)
    ax.axhline(0.85, color="black", linestyle="--", linewidth=1, label="target 0.85")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_ylabel("of a pinned cudaMemcpy of the same bytes")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{reports[0]['device']}: pool <-> paged HBM, same-run floor")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
