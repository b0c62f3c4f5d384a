"""The worker's copy between the shared pool and vLLM's paged KV, beside memcpy.

    kvtier bench kv-copy [--tokens 8192] [--page 64KiB] [--layers 4]

A DRAM hit of ``tokens`` tokens loads ``tokens / block_size`` pages per layer from the pool
into the KV blocks vLLM allocated. This times exactly what the connector's worker runs
(``PagedKV.load_layer`` / ``save_layer`` on a real shared segment) for consecutive block ids
(a fresh request's usual case) and for scattered ones (a fragmented KV cache), beside:
- the floor: one memcpy of the same bytes between page-aligned buffers;
- the checksum pass ``verify_loads`` adds to every load (XXH3-64 of each chunk);
- ``index_copy_``, the obvious torch call, which on CPU moves ~0.3 GB/s and was what the
  worker used before (kept here so the reason for the run-coalesced copy stays measurable).
CPU tensors only; on a CUDA machine the worker copies host → device and this bench does not
apply.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from kvtier.bench.micro.timing import best_of
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.paged_kv import PagedKV, PoolView
from kvtier.store.client.shm import SharedSegment, checksum_views, page_aligned_empty

BLOCK_SIZE = 32


def whole_chunks(geo: KvGeometry, block_ids: list[int]) -> list[ChunkCopy]:
    """Chunks over ``block_ids`` (whole chunks, in order), stored back to back from the
    pool's start: what one request's run of a DRAM hit copies."""
    per = geo.blocks_per_chunk
    return [
        ChunkCopy(
            ((c * geo.chunk_bytes, geo.chunk_bytes),),
            0,
            0,
            tuple(block_ids[c * per : (c + 1) * per]),
        )
        for c in range(len(block_ids) // per)
    ]


def run(
    tokens: int = 8192,
    page_bytes: int = 64 << 10,
    layers: int = 4,
    chunk_tokens: int = 256,
    repeat: int = 5,
) -> dict:
    blocks = tokens // BLOCK_SIZE
    per_chunk = chunk_tokens // BLOCK_SIZE
    chunks = blocks // per_chunk
    names = tuple(f"layer.{i}" for i in range(layers))
    geo = KvGeometry(names, BLOCK_SIZE, page_bytes, chunk_tokens, "bench")
    total = chunks * geo.chunk_bytes
    num_blocks = 2 * blocks + 16  # room for scattered ids
    kv = {name: torch.zeros(num_blocks, page_bytes, dtype=torch.uint8) for name in names}
    paged = PagedKV(kv, geo)
    segment = SharedSegment.create(f"kvtier-bench-kvcopy-{os.getpid()}", total)
    try:
        segment.array[:] = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
        pool = PoolView(segment, pin=False)
        consecutive = list(range(8, 8 + blocks))
        scattered = random.Random(0).sample(range(num_blocks), blocks)

        def copies(ids: list[int]) -> list[ChunkCopy]:
            return whole_chunks(geo, ids)

        def load(ids: list[int]) -> None:
            plan = paged.plan(copies(ids))
            for layer in range(layers):
                paged.load_layer(layer, pool, plan)

        def save(ids: list[int]) -> None:
            plan = paged.plan(copies(ids))
            for layer in range(layers):
                paged.save_layer(layer, pool, plan)

        def index_copy(ids: list[int]) -> None:
            for layer, name in enumerate(names):
                for c, job in enumerate(copies(ids)):
                    start = c * geo.chunk_bytes + layer * geo.layer_bytes
                    src = pool.tensor[start : start + geo.layer_bytes].view(-1, page_bytes)
                    kv[name].index_copy_(0, torch.tensor(job.block_ids), src)

        def verify() -> None:  # what verify_loads adds to a load: XXH3-64 of every chunk
            for c in range(chunks):
                checksum_views([segment.array[c * geo.chunk_bytes : (c + 1) * geo.chunk_bytes]])

        src_buf, dst_buf = page_aligned_empty(total), page_aligned_empty(total)
        rows = [
            ("floor: memcpy", best_of(lambda: np.copyto(dst_buf, src_buf), repeat, warmup=1)),
            ("load, consecutive blocks", best_of(lambda: load(consecutive), repeat, warmup=1)),
            ("load, scattered blocks", best_of(lambda: load(scattered), repeat, warmup=1)),
            ("save, consecutive blocks", best_of(lambda: save(consecutive), repeat, warmup=1)),
            ("save, scattered blocks", best_of(lambda: save(scattered), repeat, warmup=1)),
            ("verify_loads: checksum the chunks", best_of(verify, repeat, warmup=1)),
            ("index_copy_ load, consecutive", best_of(lambda: index_copy(consecutive), 1, 1)),
        ]
    finally:
        segment.close()
        segment.unlink()
    floor = rows[0][1]
    return {
        "tokens": tokens,
        "page_bytes": page_bytes,
        "layers": layers,
        "bytes": total,
        "torch_threads": torch.get_num_threads(),
        "rows": [
            {"what": what, "seconds": s, "gb_per_s": total / s / 1e9, "of_memcpy": floor / s}
            for what, s in rows
        ],
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"pool <-> paged KV for {report['tokens']:,} tokens: {report['bytes'] >> 20} MiB "
        f"in {report['page_bytes'] >> 10} KiB pages x {report['layers']} layers"
    )
    for col in ("what", "ms", "GB/s", "of memcpy"):
        table.add_column(col, justify="right")
    for row in report["rows"]:
        table.add_row(
            row["what"],
            f"{row['seconds'] * 1e3:.2f}",
            f"{row['gb_per_s']:.2f}",
            f"{row['of_memcpy']:.0%}",
        )
    console().print(table)
