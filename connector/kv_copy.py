"""Copies between vLLM's paged KV and chunks in the node's shared pool.

A chunk holds, layer after layer, the pages of its ``blocks_per_chunk`` blocks (see
``layout.py``). Loading copies a run of a chunk's pages into the KV pages of the request's
blocks; saving copies the other way. ``PagedKV`` views every layer's KV as
``[num_blocks, page_bytes]`` uint8 rows, whatever the backend's page interior.

- CPU backend: memcpys (numpy) on the calling thread, one per run of consecutive block ids
  (a request's blocks mostly are). Not ``index_copy_``: on CPU it copies element by element,
  0.3 GB/s against ~10 GB/s for a slice copy, and was most of a DRAM hit's cost
  (``kvtier bench kv-copy`` measures both).
- CUDA: the pool is registered with CUDA (pinned host memory) and copies run on a side stream
  ordered after the compute stream's writes; ``synchronize`` waits for them. (Written for
  CUDA KV layouts but, as of this commit, only exercised on the CPU backend.)

Threading: one ``PagedKV`` per worker, used from the model-runner thread and the load thread
it starts for layer-wise loads (different layers, never the same pages at once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.streams import DeviceOrdering, HostOrdering
from kvtier.tiers.cpu.shm import SharedSegment

log = logging.getLogger(__name__)


def page_rows(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` (one layer, blocks first) as ``[num_blocks, page_bytes]`` uint8 rows.

    Each block's page must be contiguous (true of vLLM's layouts: CPU's contiguous tensors and
    CUDA's strided per-layer views alike); rows may be strided.
    """
    if not kv[0].is_contiguous():
        raise ValueError(f"a KV block page is not contiguous (shape {tuple(kv.shape)})")
    num_blocks, page_elems = kv.shape[0], kv[0].numel()
    rows = torch.as_strided(kv, (num_blocks, page_elems), (kv.stride(0), 1))
    return rows.view(torch.uint8)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first block id, count)`` for each run of consecutive ids in ``block_ids``,
    ``position`` being the run's index in ``block_ids``."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(block_ids):
        if runs:
            first_pos, first_block, count = runs[-1]
            if block == first_block + count:
                runs[-1] = (first_pos, first_block, count + 1)
                continue
        runs.append((position, block, 1))
    return runs


def _pieces(
    extents: Sequence[tuple[int, int]], start: int, length: int
) -> Iterator[tuple[int, int]]:
    """Segment (offset, length) pieces covering chunk bytes ``[start, start + length)``."""
    pos = 0
    for offset, size in extents:
        lo, hi = max(start, pos), min(start + length, pos + size)
        if lo < hi:
            yield offset + lo - pos, hi - lo
        pos += size
        if pos >= start + length:
            return


def _host_pages(
    pool: PoolView, extents: Sequence[tuple[int, int]], start: int, count: int, page_bytes: int
) -> np.ndarray:
    """Chunk bytes ``[start, start + count pages)`` as ``[count, page_bytes]``: a view of the
    pool, or a copy when they span extents (a chunk the allocator had to split).

    ``PoolView.read`` in numpy: slicing and viewing torch tensors costs a few µs per chunk and
    layer, 15 % of an 8k-token load (``kvtier bench kv-copy``), so the CPU path skips torch."""
    pieces = list(_pieces(extents, start, count * page_bytes))
    array = pool.segment.array
    if len(pieces) == 1:
        offset, n = pieces[0]
        return array[offset : offset + n].reshape(count, page_bytes)
    return np.concatenate([array[o : o + n] for o, n in pieces]).reshape(count, page_bytes)


class PoolView:
    """A pool segment as a torch uint8 tensor (registered with CUDA when asked)."""

    def __init__(self, segment: SharedSegment, pin: bool) -> None:
        self.segment = segment
        self.tensor = torch.from_numpy(segment.array)
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(
                self.tensor.data_ptr(), self.tensor.numel(), 0
            )
            self.pinned = int(rc[0] if isinstance(rc, tuple) else rc) == 0
            if not self.pinned:
                log.warning("cudaHostRegister of the pool failed (%s): copies will block", rc)

    def read(self, extents: Sequence[tuple[int, int]], start: int, length: int) -> torch.Tensor:
        """Chunk bytes ``[start, start + length)``: a view, or a copy if they span extents."""
        pieces = list(_pieces(extents, start, length))
        if len(pieces) == 1:
            offset, n = pieces[0]
            return self.tensor[offset : offset + n]
        return torch.cat([self.tensor[o : o + n] for o, n in pieces])

    def write(
        self,
        extents: Sequence[tuple[int, int]],
        start: int,
        data: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        flat = data.reshape(-1)
        pos = 0
        for offset, n in _pieces(extents, start, flat.numel()):
            self.tensor[offset : offset + n].copy_(flat[pos : pos + n], non_blocking=non_blocking)
            pos += n

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


class PagedKV:
    def __init__(self, kv_caches: dict[str, torch.Tensor], geometry: KvGeometry) -> None:
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV caches lack layers {missing[:3]}")
        self.geometry = geometry
        self.rows = [page_rows(kv_caches[name]) for name in geometry.layer_names]
        for name, rows in zip(geometry.layer_names, self.rows, strict=True):
            if rows.shape[1] != geometry.page_bytes:
                raise ValueError(
                    f"layer {name}: page is {rows.shape[1]} bytes, expected {geometry.page_bytes}"
                )
        self.device = self.rows[0].device
        self.is_cuda = self.device.type == "cuda"
        self.ordering: HostOrdering | DeviceOrdering = (
            DeviceOrdering(self.device, len(self.rows)) if self.is_cuda else HostOrdering()
        )
        # CPU: numpy views of the same memory; np.copyto costs ~1 µs a call against ~10 µs
        # for torch's copy_, which matters with one call per run of blocks.
        self.host_rows = [] if self.is_cuda else [rows.numpy() for rows in self.rows]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def load_layer(self, layer: int, pool: PoolView, chunks: Sequence[ChunkCopy]) -> None:
        """Copy layer ``layer`` of ``chunks`` from the pool into the KV pages."""
        geo = self.geometry
        with self.ordering.copying():
            for chunk in chunks:
                count = len(chunk.block_ids)
                start = layer * geo.layer_bytes + chunk.first_block * geo.page_bytes
                if not self.is_cuda:
                    src_pages = _host_pages(pool, chunk.extents, start, count, geo.page_bytes)
                    rows = self.host_rows[layer]
                    for position, block, n in block_runs(chunk.block_ids):
                        np.copyto(rows[block : block + n], src_pages[position : position + n])
                    continue
                src = pool.read(chunk.extents, start, count * geo.page_bytes)
                src = src.view(count, geo.page_bytes).to(self.device, non_blocking=pool.pinned)
                self.rows[layer].index_copy_(0, self._index(chunk.block_ids), src)
            self.ordering.layer_loaded(layer)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer ``layer``'s load (CUDA); no-op on CPU."""
        self.ordering.wait_layer(layer)

    def save_layer(self, layer: int, pool: PoolView, chunks: Sequence[ChunkCopy]) -> None:
        """Copy layer ``layer`` of the KV pages of ``chunks`` into the pool."""
        geo = self.geometry
        with self.ordering.copying():
            for chunk in chunks:
                count = len(chunk.block_ids)
                start = layer * geo.layer_bytes + chunk.first_block * geo.page_bytes
                pieces = list(_pieces(chunk.extents, start, count * geo.page_bytes))
                if not self.is_cuda and len(pieces) == 1:  # gather straight into the pool
                    offset, n = pieces[0]
                    dst = pool.segment.array[offset : offset + n].reshape(count, geo.page_bytes)
                    rows = self.host_rows[layer]
                    for position, block, run in block_runs(chunk.block_ids):
                        np.copyto(dst[position : position + run], rows[block : block + run])
                    continue
                pages = torch.index_select(self.rows[layer], 0, self._index(chunk.block_ids))
                pool.write(chunk.extents, start, pages, non_blocking=self.is_cuda and pool.pinned)

    def synchronize(self) -> None:
        """Wait for every copy issued so far (CUDA); no-op on CPU."""
        self.ordering.synchronize()
