"""Byte-exact copies between a real shared pool segment and paged KV tensors (CPU path).

The connector's worker copies pages with run-coalesced slice copies on CPU; these tests pin
down that every page lands where the chunk layout says, for consecutive and scattered block
ids, chunks split across pool extents, and partial chunks (a run starting mid-chunk).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.worker import PagedKV, PoolView, block_runs
from kvtier.store.client.shm import SharedSegment

LAYERS = 3
BLOCK_SIZE = 32
BLOCKS_PER_CHUNK = 4
NUM_BLOCKS = 64
# CPU attention layout: [num_blocks, 2 (K|V), kv_heads, block_size, head_dim], fp32
PAGE_SHAPE = (2, 2, BLOCK_SIZE, 8)
PAGE_BYTES = 2 * 2 * BLOCK_SIZE * 8 * 4


@pytest.fixture
def segment():
    seg = SharedSegment.create(f"kvtier-test-kvcopy-{os.getpid()}", 1 << 20)
    try:
        yield seg
    finally:
        seg.close()
        seg.unlink()


def _geometry() -> KvGeometry:
    names = tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))
    return KvGeometry(names, BLOCK_SIZE, PAGE_BYTES, BLOCK_SIZE * BLOCKS_PER_CHUNK, "test")


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    make = torch.randn if seed is not None else (lambda *shape, generator: torch.zeros(*shape))
    return {name: make(NUM_BLOCKS, *PAGE_SHAPE, generator=gen) for name in _geometry().layer_names}


def _page(kv: dict[str, torch.Tensor], layer: int, block: int) -> bytes:
    name = _geometry().layer_names[layer]
    return kv[name][block].contiguous().view(torch.uint8).numpy().tobytes()


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([7]) == [(0, 7, 1)]
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert block_runs([5, 4]) == [(0, 5, 1), (1, 4, 1)]  # descending ids are not a run


@pytest.mark.parametrize(
    "source_blocks, target_blocks",
    [
        ((10, 11, 12, 13), (40, 41, 42, 43)),  # one run each way
        ((1, 30, 31, 7), (60, 2, 3, 50)),  # scattered, runs of every length
    ],
)
@pytest.mark.parametrize("split", [False, True], ids=["one-extent", "two-extents"])
def test_save_then_load_round_trips_every_page(
    segment: SharedSegment, source_blocks: tuple, target_blocks: tuple, split: bool
) -> None:
    geo = _geometry()
    if split:  # the chunk's bytes in two pieces of the pool, the cut inside a page
        cut = geo.layer_bytes + PAGE_BYTES // 2
        extents = ((4096, cut), (65536, geo.chunk_bytes - cut))
    else:
        extents = ((8192, geo.chunk_bytes),)
    source, target = _kv(seed=1), _kv(seed=None)
    pool = PoolView(segment, pin=False)
    saver, loader = PagedKV(source, geo), PagedKV(target, geo)

    chunk_out = ChunkCopy(extents, 0, 0, source_blocks)
    for layer in range(LAYERS):
        saver.save_layer(layer, pool, [chunk_out])
    # The pool holds, layer after layer, the chunk's pages in order.
    pool_bytes = b"".join(segment.read([e]) for e in extents)
    for layer in range(LAYERS):
        for i, block in enumerate(source_blocks):
            at = layer * geo.layer_bytes + i * PAGE_BYTES
            assert pool_bytes[at : at + PAGE_BYTES] == _page(source, layer, block)

    # Load the last three pages of the chunk (a run starting mid-chunk), then the first one.
    tail = ChunkCopy(extents, 0, 1, target_blocks[1:])
    head = ChunkCopy(extents, 0, 0, target_blocks[:1])
    for layer in range(LAYERS):
        loader.load_layer(layer, pool, [tail, head])
    for layer in range(LAYERS):
        for src_block, dst_block in zip(source_blocks, target_blocks, strict=True):
            assert _page(target, layer, dst_block) == _page(source, layer, src_block)
    untouched = set(range(NUM_BLOCKS)) - set(target_blocks)
    zero_page = bytes(PAGE_BYTES)
    assert all(_page(target, layer, b) == zero_page for layer in range(LAYERS) for b in untouched)
