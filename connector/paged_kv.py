"""The worker's copies: one layer of some chunks between the node's pool and vLLM's paged KV.

A chunk holds, layer after layer, the pages of its ``blocks_per_chunk`` blocks (``layout.py``);
a page is one layer's KV of one block, copied as the bytes it occupies in vLLM's memory.
vLLM 0.32 registers one ``[B, H, N, C]`` view per layer whose strides follow the resolved
``KVCacheLayout`` (``page_rows`` says which layouts keep a page in one run of memory); the
namespace's ``kv_layout`` names the layout, so instances share chunks only when their pages
hold the same bytes in the same order.

- CPU backend: memcpys (numpy) on the calling thread, one per run of consecutive block ids (a
  request's blocks mostly are). Not ``index_copy_``: on CPU it copies element by element,
  0.3 GB/s against ~10 GB/s for a slice copy (``kvtier bench kv-copy`` measures both).
- CUDA: the pool is registered with CUDA (pinned host memory, ``PoolView``) and the copy
  engine moves the bytes (``cudaMemcpyAsync`` through the CUDA runtime, ``cuda_copy.Memcpy``)
  on side streams (``streams.py``). A chunk whose block ids form runs of at least
  ``DIRECT_MIN_BYTES`` in a layout where consecutive blocks are adjacent moves run by run,
  straight between the pool and its pages. Every other chunk (scattered ids, cross-layer
  layouts) is staged: one copy per chunk between the pool and a device buffer, and one
  ``index_copy_`` (on its own stream, overlapping the next layer's uploads) or
  ``index_select`` per layer for all of them. Block ids reach the GPU once per job (pinned,
  non-blocking), not once per layer: a ``torch.tensor(ids, device="cuda")`` is a pageable
  copy that waits for the stream, which would put every chunk's copy behind the previous one.
  ``cuda_copy.py`` also has a copy kernel (every page of a layer in one launch); it is off by
  default because it takes the SMs the forward needs (``connector.cuda_copy_kernel``).

Threading: one ``PagedKV`` per worker. ``load_layer`` runs on the ``kvtier-load`` thread or the
model-runner thread, ``save_layer`` on the model-runner thread; a load and a save never touch
the same pages at once (the scheduler saves only computed blocks, after their layer's
forward, which waited for that layer's load).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.connector import cuda_copy
from kvtier.connector.layout import MAMBA, KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.streams import DeviceOrdering, HostOrdering
from kvtier.core.chunks import extent_pieces
from kvtier.store.client.shm import SharedSegment

log = logging.getLogger(__name__)

# Runs shorter than this are staged rather than copied one by one: each copy costs a call
# (~1-2 µs) and the copy engine's setup (~3 µs on an H200), while staging adds one pass over
# HBM (~0.2 µs for 256 KiB) and makes one copy per chunk.
DIRECT_MIN_BYTES = 256 << 10


class UnsupportedLayout(ValueError):
    """vLLM's KV cache layout splits a block's page over more than one run of memory."""


def page_rows(kv: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """One layer's KV as ``[num_blocks, page_bytes]`` uint8 rows over the same memory.

    ``kv`` is the view vLLM registers for the layer, blocks first (``[B, H, N, C]``, any
    stride order inside). Each block's page must be one run of memory, in whatever order its
    H, N and C lie there: true of every block-compact layout (LBHNC, LBNHC, BLHNC, BLNHC);
    LHBNC and BHLNC interleave other blocks or layers between a page's heads and are refused.
    A backend whose kernel blocks are smaller than the manager's blocks registers ``ratio``
    kernel blocks per block; adjacent in memory (vLLM requires it), they form one page here.
    Rows may be strided (cross-layer layouts put the other layers' pages between blocks).
    """
    item = kv.element_size()
    span = 1
    for stride, size in sorted((kv.stride(d), kv.shape[d]) for d in range(1, kv.dim())):
        if size == 1:
            continue
        if stride != span:
            raise UnsupportedLayout(
                f"a KV block's page is not one run of memory (shape {tuple(kv.shape)}, "
                f"strides {kv.stride()}): kvtier copies pages whole and supports vLLM's "
                "block-compact layouts (LBNHC, LBHNC, BLNHC, BLHNC); set "
                "VLLM_KV_CACHE_LAYOUT=LBNHC"
            )
        span *= size
    kernel_page = span * item
    ratio, rest = divmod(page_bytes, kernel_page)
    block_stride = kv.stride(0) * item
    if rest or ratio < 1 or kv.shape[0] % ratio:
        raise UnsupportedLayout(
            f"a KV block's page is {page_bytes} bytes, the registered view holds "
            f"{kernel_page} bytes per block (shape {tuple(kv.shape)})"
        )
    if ratio > 1:
        if block_stride != kernel_page:
            raise UnsupportedLayout(
                f"the {ratio} kernel blocks of a KV block are not adjacent in memory"
            )
        block_stride *= ratio
    storage = storage_bytes(kv)
    return torch.as_strided(
        storage, (kv.shape[0] // ratio, page_bytes), (block_stride, 1), kv.storage_offset() * item
    )


def state_page_rows(states: Sequence[torch.Tensor], page_bytes: int) -> torch.Tensor:
    """One Mamba layer's state as ``[num_blocks, page_bytes]`` uint8 rows.

    vLLM registers a Mamba layer as a list of views (conv state, SSM state, ...) into one
    allocation, each blocks first with a block stride of the (padded) page: block ``b``'s
    state is the page ``[b * page_bytes, (b + 1) * page_bytes)`` from where the first view
    starts, padding included. Anything else is refused."""
    if not states:
        raise UnsupportedLayout("a Mamba layer registered no state tensors")
    base = states[0]
    start = base.storage_offset() * base.element_size()
    for state in states:
        item = state.element_size()
        offset = state.storage_offset() * item - start
        inner = (state[0].numel() if state.shape[0] else 0) * item
        if (
            state.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
            or state.stride(0) * item != page_bytes
            or not state[0].is_contiguous()
            or offset < 0
            or offset + inner > page_bytes
        ):
            raise UnsupportedLayout(
                f"a Mamba state view (shape {tuple(state.shape)}, strides {state.stride()}) "
                f"is not laid out as one {page_bytes}-byte page per block"
            )
    storage = storage_bytes(base)
    if start + base.shape[0] * page_bytes > storage.numel():  # the last page's padding too
        raise UnsupportedLayout("a Mamba layer's allocation ends inside its last page")
    return torch.as_strided(storage, (base.shape[0], page_bytes), (page_bytes, 1), start)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole allocation ``tensor`` views, as flat uint8 (offsets address its pages)."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(tensor.untyped_storage())


def _rows(kv: torch.Tensor | Sequence[torch.Tensor], page_bytes: int, state: bool) -> torch.Tensor:
    """A layer's pages: ``state`` for a Mamba layer (one tensor or a list of them)."""
    if not state:
        assert isinstance(kv, torch.Tensor)
        return page_rows(kv, page_bytes)
    return state_page_rows([kv] if isinstance(kv, torch.Tensor) else kv, page_bytes)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the widest integer elements its strides allow: index kernels move one
    element per thread, so 8-byte elements move a page 8x faster than bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        strides = (rows.shape[1], rows.stride(0), rows.storage_offset())
        if all(n % size == 0 for n in strides):
            return rows.view(dtype)
    return rows


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


def _host_pages(
    pool: PoolView, extents: Sequence[tuple[int, int]], start: int, count: int, page_bytes: int
) -> np.ndarray:
    """Chunk bytes ``[start, start + count pages)`` as ``[count, page_bytes]``: a view of the
    pool, or a copy when they span extents (a chunk the allocator had to split).

    ``PoolView.read`` in numpy: slicing and viewing torch tensors costs a few µs per chunk and
    layer, 15 % of an 8k-token load (``kvtier bench kv-copy``), so the CPU path skips torch."""
    pieces = list(extent_pieces(extents, start, count * page_bytes))
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
        self.device_words: torch.Tensor | None = None  # the GPU's view of the pool (CUDA)
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(
                self.tensor.data_ptr(), self.tensor.numel(), 0
            )
            self.pinned = int(rc[0] if isinstance(rc, tuple) else rc) == 0
            if not self.pinned:
                log.warning("cudaHostRegister of the pool failed (%s): copies will block", rc)
            elif cuda_copy.available():
                self.device_words = cuda_copy.device_words(self.tensor)

    def read(self, extents: Sequence[tuple[int, int]], start: int, length: int) -> torch.Tensor:
        """Chunk bytes ``[start, start + length)``: a view, or a copy if they span extents."""
        pieces = list(extent_pieces(extents, start, length))
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
        for offset, n in extent_pieces(extents, start, flat.numel()):
            self.tensor[offset : offset + n].copy_(flat[pos : pos + n], non_blocking=non_blocking)
            pos += n

    def close(self) -> None:
        """Stop using the segment: unregister it from CUDA (before anything unmaps it) and
        drop this view's tensors, so that ``segment.close()`` really unmaps it (a live tensor
        over the mapping would keep it, and the dead store's memory, until collected). The
        segment stays its owner's to close."""
        self.device_words = None
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)


@dataclass
class CopyPlan:
    """One job's chunks, worked out once for every layer copied: each chunk's runs of
    consecutive block ids; on CUDA the kernel's segments, and for the memcpy path which
    chunks move run by run (``direct``) and which through the staging buffer (their block
    ids in ``staged_ids``, in chunk order)."""

    chunks: Sequence[ChunkCopy]
    runs: list[list[tuple[int, int, int]]]
    direct: list[bool]
    staged_ids: list[int] = field(default_factory=list)
    kernel: cuda_copy.KernelPlan | None = None  # CUDA: the one-kernel-per-layer copy
    by_group: dict[int, CopyPlan] | None = None  # hybrid models: each group's own plan
    _index: torch.Tensor | None = None

    def for_group(self, group: int) -> CopyPlan:
        return self if self.by_group is None else self.by_group[group]

    def staged_index(self, device: torch.device) -> torch.Tensor:
        """The staged block ids on the device; uploaded by the first layer's copy, on its
        stream, so every later layer (same stream) finds them there."""
        if self._index is None:
            host = torch.tensor(self.staged_ids, dtype=torch.long).pin_memory()
            self._index = host.to(device, non_blocking=True)
        return self._index


class PagedKV:
    """vLLM's registered KV caches as page rows, and the copies between them and the pool."""

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], geometry: KvGeometry, copy_kernel: bool = False
    ) -> None:
        """``copy_kernel`` (``connector.cuda_copy_kernel``): on CUDA, copy with
        ``cuda_copy``'s kernel where it can run. It moves a layer in one launch but runs on
        the SMs the forward needs: on an H200 a layer-wise 8k-token load under a forward hid
        4 % of the load with it against 56 % with the copy engine (docs/benchmarks.md)."""
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV caches lack layers {missing[:3]}")
        self.geometry = geometry
        self.rows = [
            _rows(
                kv_caches[n],
                geometry.page_bytes,
                geometry.groups[geometry.group_of(i)].kind == MAMBA,
            )
            for i, n in enumerate(geometry.layer_names)
        ]
        self.device = self.rows[0].device
        self.is_cuda = self.device.type == "cuda"
        self.ordering: HostOrdering | DeviceOrdering = (
            DeviceOrdering(self.device, len(self.rows)) if self.is_cuda else HostOrdering()
        )
        # consecutive block ids are adjacent pages (layer-compact layouts)
        self.dense = all(rows.stride(0) == geometry.page_bytes for rows in self.rows)
        self.wide_rows = [_wide(rows) for rows in self.rows] if self.is_cuda else []
        # CUDA kernel path: the allocation every layer lives in, as words, and where each
        # layer's block 0 sits in it; None (memcpy path) without Triton or one allocation
        strides = {rows.stride(0) for rows in self.rows}
        self.block_stride = strides.pop() if len(strides) == 1 else 0
        self.layer_offsets = [int(rows.storage_offset()) for rows in self.rows]
        # each layer's whole allocation as flat bytes: copies address pages by offset
        self.kv_flat = [storage_bytes(rows) for rows in self.rows]
        self.memcpy = cuda_copy.Memcpy(runtime=self.is_cuda)
        self.kv_words: torch.Tensor | None = None
        if self.is_cuda and cuda_copy.available() and self.block_stride:
            self.kv_words = cuda_copy.storage_words(self.kv_flat)
        # the kernel addresses every layer at layer * layer_bytes: one full-attention layout
        self.use_kernel = copy_kernel and self.kv_words is not None and geometry.uniform
        # CPU: numpy views of the same memory; np.copyto costs ~1 µs a call against ~10 µs
        # for torch's copy_, which matters with one call per run of blocks.
        self.host_rows = [] if self.is_cuda else [rows.numpy() for rows in self.rows]

    def plan(self, chunks: Sequence[ChunkCopy]) -> CopyPlan:
        """One plan for every layer; a hybrid model's has a sub-plan per KV cache group (its
        layers copy that group's blocks only)."""
        if len(self.geometry.groups) == 1:
            return self._plan(chunks)
        by_group = {
            g: self._plan([c for c in chunks if c.group == g])
            for g in range(len(self.geometry.groups))
        }
        return CopyPlan(chunks, [], [], by_group=by_group)

    def _plan(self, chunks: Sequence[ChunkCopy]) -> CopyPlan:
        runs = [block_runs(chunk.block_ids) for chunk in chunks]
        if not self.is_cuda:
            return CopyPlan(chunks, runs, [True] * len(chunks))
        kernel = None
        if self.use_kernel:
            offsets, stride = self.layer_offsets, self.block_stride
            kernel = cuda_copy.kernel_plan(chunks, self.geometry, offsets, stride)
        page = self.geometry.page_bytes
        direct = [self.dense and min(n for _, _, n in r) * page >= DIRECT_MIN_BYTES for r in runs]
        staged = [b for c, d in zip(chunks, direct, strict=True) if not d for b in c.block_ids]
        return CopyPlan(chunks, runs, direct, staged, kernel)

    def _start(self, layer: int, chunk: ChunkCopy) -> int:
        """Where layer ``layer``'s first copied page of ``chunk`` sits in the chunk's bytes."""
        return self.geometry.layer_offset(layer) + chunk.first_block * self.geometry.page_bytes

    def _by_kernel(self, plan: CopyPlan, pool: PoolView) -> bool:
        return self.use_kernel and plan.kernel is not None and pool.device_words is not None

    def _layer_target(self, layer: int) -> tuple[torch.Tensor, int, int, int]:
        """Layer ``layer``'s allocation as flat bytes, where its block 0 sits there, its block
        stride, and the current (side) stream's handle for the runtime's copies."""
        stream = self.ordering.current() if self.memcpy.cudart is not None else 0
        stride = int(self.rows[layer].stride(0))
        return self.kv_flat[layer], self.layer_offsets[layer], stride, stream

    def bind_compute(self) -> None:
        """Start of a step, on the model-runner thread (``streams.py``)."""
        self.ordering.bind_compute()

    def load_layer(self, layer: int, pool: PoolView, plan: CopyPlan) -> None:
        """Copy layer ``layer`` of the plan's chunks from the pool into the KV pages."""
        plan = plan.for_group(self.geometry.group_of(layer))
        page = self.geometry.page_bytes
        if not self.is_cuda:
            rows = self.host_rows[layer]
            for chunk, runs in zip(plan.chunks, plan.runs, strict=True):
                count = len(chunk.block_ids)
                src = _host_pages(pool, chunk.extents, self._start(layer, chunk), count, page)
                for position, block, n in runs:
                    np.copyto(rows[block : block + n], src[position : position + n])
            return
        with self.ordering.loading():
            if self._by_kernel(plan, pool):
                assert plan.kernel and pool.device_words is not None and self.kv_words is not None
                plan.kernel.copy(layer, pool.device_words, self.kv_words, load=True)
                self.ordering.layer_loaded(layer)
                return
            kv, base, stride, stream = self._layer_target(layer)
            staging = None
            if plan.staged_ids:
                staging = torch.empty(
                    len(plan.staged_ids) * page, dtype=torch.uint8, device=self.device
                )
            at = 0
            for chunk, runs, direct in zip(plan.chunks, plan.runs, plan.direct, strict=True):
                start = self._start(layer, chunk)
                if direct:
                    for position, block, n in runs:
                        self._from_pool(
                            kv,
                            base + block * stride,
                            pool,
                            chunk,
                            start + position * page,
                            n * page,
                            stream,
                        )
                else:
                    assert staging is not None
                    count = len(chunk.block_ids)
                    self._from_pool(staging, at * page, pool, chunk, start, count * page, stream)
                    at += count
            if staging is None:
                self.ordering.layer_loaded(layer)
                return
            index = plan.staged_index(self.device)  # uploaded on the load stream, once
            with self.ordering.scattering():
                wide = self.wide_rows[layer]
                wide.index_copy_(0, index, staging.view(-1, page).view(wide.dtype))
                if self.is_cuda and staging.is_cuda:  # not reused before the scatter read it
                    staging.record_stream(torch.cuda.current_stream(self.device))
            self.ordering.layer_loaded(layer, scattered=True)

    def _from_pool(
        self,
        dst: torch.Tensor,
        dst_at: int,
        pool: PoolView,
        chunk: ChunkCopy,
        start: int,
        n: int,
        stream: int,
    ) -> None:
        """Chunk bytes ``[start, start + n)`` from the pool into ``dst`` at ``dst_at``."""
        for offset, length in extent_pieces(chunk.extents, start, n):
            self.memcpy(dst, dst_at, pool.tensor, offset, length, cuda_copy.H2D, stream)
            dst_at += length

    def _to_pool(
        self,
        pool: PoolView,
        chunk: ChunkCopy,
        start: int,
        src: torch.Tensor,
        src_at: int,
        n: int,
        stream: int,
    ) -> None:
        """``n`` bytes of ``src`` from ``src_at`` into chunk bytes ``[start, start + n)``."""
        for offset, length in extent_pieces(chunk.extents, start, n):
            self.memcpy(pool.tensor, offset, src, src_at, length, cuda_copy.D2H, stream)
            src_at += length

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer ``layer``'s load (CUDA); no-op on CPU."""
        self.ordering.wait_layer(layer)

    def save_layer(self, layer: int, pool: PoolView, plan: CopyPlan) -> None:
        """Copy layer ``layer`` of the KV pages of the plan's chunks into the pool."""
        plan = plan.for_group(self.geometry.group_of(layer))
        page = self.geometry.page_bytes
        if not self.is_cuda:
            rows = self.host_rows[layer]
            for chunk, runs in zip(plan.chunks, plan.runs, strict=True):
                count = len(chunk.block_ids)
                start = self._start(layer, chunk)
                pieces = list(extent_pieces(chunk.extents, start, count * page))
                if len(pieces) == 1:  # gather straight into the pool
                    offset, n = pieces[0]
                    dst = pool.segment.array[offset : offset + n].reshape(count, page)
                    for position, block, run in runs:
                        np.copyto(dst[position : position + run], rows[block : block + run])
                else:
                    ids = list(chunk.block_ids)
                    pool.write(chunk.extents, start, torch.from_numpy(rows[ids]))
            return
        with self.ordering.saving():
            if self._by_kernel(plan, pool):
                assert plan.kernel and pool.device_words is not None and self.kv_words is not None
                plan.kernel.copy(layer, self.kv_words, pool.device_words, load=False)
                return
            kv, base, stride, stream = self._layer_target(layer)
            staging = None
            if plan.staged_ids:
                wide = self.wide_rows[layer]
                staging = wide.index_select(0, plan.staged_index(self.device)).view(torch.uint8)
                staging = staging.view(-1)
            at = 0
            for chunk, runs, direct in zip(plan.chunks, plan.runs, plan.direct, strict=True):
                start = self._start(layer, chunk)
                if direct:
                    for position, block, n in runs:
                        self._to_pool(
                            pool,
                            chunk,
                            start + position * page,
                            kv,
                            base + block * stride,
                            n * page,
                            stream,
                        )
                else:
                    assert staging is not None
                    count = len(chunk.block_ids)
                    self._to_pool(pool, chunk, start, staging, at * page, count * page, stream)
                    at += count

    def finish_loads(self) -> None:
        """Wait for every load copy issued so far (CUDA); no-op on CPU."""
        self.ordering.finish_loads()

    def finish_saves(self) -> None:
        """Wait for every save copy issued so far (CUDA); no-op on CPU."""
        self.ordering.finish_saves()
