"""A paged KV cache as vLLM 0.32 allocates it, a node pool segment, and the connector's
worker driven through engine steps in the order vLLM's model runner calls it.

Shared by tests/unit/connector/test_kv_layouts.py (CPU tensors: layouts and bytes) and
tests/gpu (CUDA: the same, plus the registered pool, side streams and events). The expected
bytes come from vLLM's placement rule (``TensorPlacement``: a page of layer ``l``, block ``b``
starts at ``offset + l * layer_stride + b * block_stride``), never from the code under test.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.bench.micro import kv_layouts
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import (
    ChunkCopy,
    KvtierMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    SaveJob,
    SegmentRef,
)
from kvtier.connector.worker import ConnectorWorker
from kvtier.core.config.connector import ConnectorConfig
from kvtier.store.client.shm import SharedSegment, checksum_views

_serial = itertools.count()


@dataclass
class StepResult:
    load_errors: set[int]
    out: KvtierWorkerMetadata


class KvRig:
    """One instance's KV cache (one group's worker) and a pool segment it saves to."""

    def __init__(
        self,
        case: kv_layouts.CacheCase,
        device: str,
        num_blocks: int = 96,
        blocks_per_chunk: int = 4,
        group: int = 0,
        seed: int = 0,
        pool_bytes: int = 64 << 20,
    ) -> None:
        self.case = case
        self.num_blocks = num_blocks
        self.buffer, self.views = kv_layouts.allocate(case, num_blocks, device)
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randint(-128, 128, self.buffer.shape, dtype=torch.int8, generator=gen)
        self.buffer.copy_(noise)
        spec = case.groups[group].spec
        self.placement = kv_layouts.placements(case, num_blocks)[group]
        self.geometry = KvGeometry(
            case.groups[group].layers,
            spec.block_size,
            spec.page_bytes,
            spec.block_size * blocks_per_chunk,
            f"test;{case.layout}",
        )
        name = f"kvtier-test-kvrig-{os.getpid()}-{next(_serial)}"
        self.segment = SharedSegment.create(name, pool_bytes)
        self.ref = SegmentRef(name, pool_bytes, 1)
        self.worker = ConnectorWorker(
            ConnectorConfig(chunk_tokens=self.geometry.chunk_tokens),
            self.geometry,
            rank=0,
        )
        try:
            self.worker.register_kv_caches(self.views)
        except BaseException:  # a refused layout: give the segment back (64 MiB of /dev/shm)
            self.close()
            raise
        self._jobs = itertools.count(1)

    def close(self) -> None:
        self.worker.shutdown()
        self.segment.close()
        self.segment.unlink()

    # -- the oracle ----------------------------------------------------------------------------

    def snapshot(self) -> np.ndarray:
        """Every byte of the KV cache allocation, on the host."""
        if self.buffer.is_cuda:
            torch.cuda.synchronize()
        return self.buffer.cpu().view(torch.uint8).numpy().copy()

    def page_at(self, layer: int, block: int) -> int:
        p = self.placement
        return p.offset + layer * p.layer_stride + block * p.block_stride

    def page(self, snapshot: np.ndarray, layer: int, block: int) -> bytes:
        at = self.page_at(layer, block)
        return snapshot[at : at + self.geometry.page_bytes].tobytes()

    def views_over(self, snapshot: np.ndarray) -> dict[str, torch.Tensor]:
        """The layer views vLLM would give over ``snapshot`` (a host copy of the allocation)."""
        buffer = torch.from_numpy(snapshot.copy()).view(torch.int8)
        return kv_layouts.layer_views(buffer, self.case, self.placement, self.num_blocks)

    def expect_loaded(
        self, before: np.ndarray, source: np.ndarray, moves: Sequence[tuple[int, int]]
    ) -> np.ndarray:
        """``before`` with, in every layer, page ``dst`` replaced by ``source``'s page ``src``."""
        expected = before.copy()
        n = self.geometry.page_bytes
        for layer in range(self.geometry.num_layers):
            for src, dst in moves:
                s, d = self.page_at(layer, src), self.page_at(layer, dst)
                expected[d : d + n] = source[s : s + n]
        return expected

    # -- jobs ----------------------------------------------------------------------------------

    def chunks(
        self, block_ids: Sequence[int], base: int = 0, split: bool = False
    ) -> list[ChunkCopy]:
        """Whole chunks over ``block_ids`` at consecutive pool offsets from ``base``;
        ``split`` puts each chunk in two extents cut inside a page (a fragmented pool)."""
        geo = self.geometry
        per = geo.blocks_per_chunk
        assert len(block_ids) % per == 0
        out = []
        for c in range(len(block_ids) // per):
            at = base + c * (2 * geo.chunk_bytes + 8192)  # room for a split chunk's gap
            if split:
                cut = geo.layer_bytes + geo.page_bytes // 2
                extents = ((at, cut), (at + geo.chunk_bytes + 4096, geo.chunk_bytes - cut))
            else:
                extents = ((at, geo.chunk_bytes),)
            ids = tuple(block_ids[c * per : (c + 1) * per])
            out.append(ChunkCopy(extents, 0, 0, ids, key=bytes([c % 256]) * 16))
        return out

    def save_job(self, chunks: list[ChunkCopy]) -> SaveJob:
        return SaveJob(next(self._jobs), "req-save", {0: self.ref}, {0: chunks})

    def load_job(self, chunks: list[ChunkCopy], is_async: bool, verify: bool = True) -> LoadJob:
        return LoadJob("req-load", {0: self.ref}, {0: chunks}, is_async=is_async, verify=verify)

    def with_checksums(self, chunks: list[ChunkCopy]) -> list[ChunkCopy]:
        """The chunks with the checksums of what the pool holds now (what a store's commit
        records)."""
        return [
            ChunkCopy(c.extents, checksum_views(self.segment.views(c.extents)), *_tail(c))
            for c in chunks
        ]

    # -- one engine step, as vLLM's model runner drives the connector -------------------------

    def step(
        self,
        loads: Sequence[LoadJob] = (),
        saves: Sequence[SaveJob] = (),
        layer_compute: Callable[[int], None] | None = None,
    ) -> StepResult:
        """start_load_kv; per layer wait_for_layer_load, the layer's compute, save_kv_layer;
        wait_for_save; get_finished, get_block_ids_with_load_errors, worker metadata."""
        meta = KvtierMetadata(loads=list(loads), saves=list(saves))
        self.worker.start_load_kv(meta)
        for layer, name in enumerate(self.geometry.layer_names):
            self.worker.wait_for_layer_load(name)
            if layer_compute is not None:
                layer_compute(layer)
            self.worker.save_layer(meta, name)
        self.worker.save(meta)
        self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        out = self.worker.take_worker_meta() or KvtierWorkerMetadata()
        return StepResult(errors, out)


def _tail(chunk: ChunkCopy) -> tuple:
    return chunk.first_block, chunk.block_ids, chunk.key


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (random bytes seen as bf16 hold NaNs, which ``torch.equal`` calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def scattered(rng: np.random.Generator, pool: Sequence[int], n: int) -> list[int]:
    return [int(b) for b in rng.choice(np.asarray(pool), n, replace=False)]


def round_trip(rig: KvRig, is_async: bool) -> None:
    """Save 12 blocks (a consecutive chunk, two scattered ones, the last two split over two
    extents) from one request's blocks, then load them into 12 other blocks, with vLLM's
    order of hooks. Checked against vLLM's placement rule: the pool's bytes after the save;
    after the load every byte of the allocation, and what each layer's attention read on the
    compute stream right after ``wait_for_layer_load`` (later layers may still be copying)."""
    rng = np.random.default_rng(1)
    per = rig.geometry.blocks_per_chunk
    source = list(range(2, 2 + per)) + scattered(rng, range(20, 48), 2 * per)
    run = list(range(8, 8 + per))
    target = run + scattered(rng, [b for b in range(2 + per, 20) if b not in run], 2 * per)
    assert len(set(target)) == len(source) and not set(target) & set(source)
    saved = rig.chunks(source[:per]) + rig.chunks(source[per:], base=32 << 20, split=True)
    before = rig.snapshot()

    result = rig.step(saves=[rig.save_job(saved)])
    assert result.out.saved and not result.out.save_failed
    assert rig.snapshot().tobytes() == before.tobytes()  # a save changes no KV byte
    geo = rig.geometry
    for chunk in saved:  # the pool holds, layer after layer, the chunk's pages
        data = b"".join(rig.segment.read([e]) for e in chunk.extents)
        for layer in range(geo.num_layers):
            for i, block in enumerate(chunk.block_ids):
                at = layer * geo.layer_bytes + i * geo.page_bytes
                assert data[at : at + geo.page_bytes] == rig.page(before, layer, block)

    loads = [
        dataclasses.replace(c, block_ids=tuple(target[i * per : (i + 1) * per]))
        for i, c in enumerate(rig.with_checksums(saved))
    ]
    seen: dict[int, torch.Tensor] = {}

    def attention(layer: int) -> None:  # reads the layer's KV on the current stream
        seen[layer] = rig.views[geo.layer_names[layer]].clone()

    result = rig.step(loads=[rig.load_job(loads, is_async=is_async)], layer_compute=attention)
    assert not result.load_errors and not result.out.load_failed
    assert result.out.loaded == {"req-load": {0}}
    expected = rig.expect_loaded(before, before, list(zip(source, target, strict=True)))
    assert rig.snapshot().tobytes() == expected.tobytes()
    if not is_async:  # a sync load is what this step's attention reads
        views = rig.views_over(expected)
        for layer, name in enumerate(geo.layer_names):
            assert same_bytes(seen[layer].cpu(), views[name]), f"layer {layer} read torn KV"


def saved_for_loading(rig: KvRig, chunks: int) -> tuple[list[ChunkCopy], list[int]]:
    """Save ``chunks`` chunks from blocks 2..; return them checksummed and aimed at blocks
    30.. (a load's copies), and those target blocks."""
    per = rig.geometry.blocks_per_chunk
    source, target = list(range(2, 2 + chunks * per)), list(range(30, 30 + chunks * per))
    saved = rig.chunks(source)
    assert rig.step(saves=[rig.save_job(saved)]).out.saved
    loads = [
        dataclasses.replace(c, block_ids=tuple(target[i * per : (i + 1) * per]))
        for i, c in enumerate(rig.with_checksums(saved))
    ]
    return loads, target


def damaged_chunk_is_named(rig: KvRig, is_async: bool) -> None:
    """Save four chunks, damage one byte of the third in the pool, load all four with
    ``verify_loads``: the load fails (every target block a load error) and the worker names
    exactly the damaged chunk, whether its checksums run on one thread or side by side."""
    loads, target = saved_for_loading(rig, 4)
    offset, size = loads[2].extents[0]
    byte = rig.segment.read([(offset + size - 1, 1)])
    rig.segment.write([(offset + size - 1, 1)], bytes([byte[0] ^ 1]))
    result = rig.step(loads=[rig.load_job(loads, is_async=is_async)])
    assert result.out.corrupt == {"req-load": {(0, loads[2].key)}}
    assert result.out.load_failed == {"req-load": {0}}
    assert result.load_errors == set(target)
