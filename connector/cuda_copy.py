"""CUDA helpers of the worker's copies: ``cudaMemcpyAsync`` through the CUDA runtime
(``Memcpy``, the default path) and a copy kernel (``KernelPlan``, ``connector.cuda_copy_kernel``).

The copy engine (``Memcpy``): ``paged_kv`` issues one copy per run of pages, so the cost of a
call matters; through ctypes it is ~1-2 µs against ~10 µs for torch's ``copy_`` on slices,
which for MLA's 72 KiB pages moved a load from 0.48-0.55 to 0.63-0.65 of a pinned ``cudaMemcpy``
(H200, ``kvtier bench kv-copy --device cuda``, docs/benchmarks.md).

The copy kernel: a pool segment registered with ``cudaHostRegister`` is mapped into the GPU's
address space, so a kernel can read (loads) or write (saves) it in place over PCIe, every
page of a layer in one launch, for any block ids, page size or KV layout. On the H200 it
reached 0.83-0.84 of the floor for MLA's pages (copy engine 0.63-0.65) and 0.85-0.87 for
64 KiB pages (copy engine 0.85), but it runs on the SMs the forward needs: a layer-wise load
under a forward then hid 4 % of itself instead of 56 %. Hence off by default.

The kernel's work is a list of *segments* (pool word offset, KV word offset, length in words)
per layer, built once per job (``segments``, host-side numpy: testable without a GPU) and
uploaded once; a page the pool split over two extents is two segments. Words are 8 bytes:
every offset and length must be a multiple of 8 (pool extents are pool-page aligned and KV
pages are whole heads), else ``segments`` returns None and the caller uses the copy engine.
It needs Triton (vLLM's CUDA build ships it) and a driver that maps registered memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.core.chunks import extent_pieces

WORD = 8  # bytes the kernel moves per element
TILE = 1024  # words per program: 8 KiB, a 64 KiB page is 8 programs

try:  # vLLM's CUDA build brings Triton; the CPU build's Triton has no CPU backend
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_segments(src, dst, src_off, dst_off, length, tiles, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        segment = pid // tiles
        tile = pid % tiles
        s = tl.load(src_off + segment)
        d = tl.load(dst_off + segment)
        n = tl.load(length + segment)
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)

    _TRITON = True
except Exception:  # ImportError, or a Triton that cannot compile here
    _TRITON = False


def available() -> bool:
    return _TRITON and torch.cuda.is_available()


class _CudaArray:
    """``__cuda_array_interface__`` over a device address, so torch can view it."""

    def __init__(self, address: int, words: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (words,),
            "typestr": "<i8",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


_CUDART: Any = None


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (by soname: no search, no second copy), or None."""
    global _CUDART
    if _CUDART is None:
        try:
            major = (torch.version.cuda or "").split(".")[0]
            lib = ctypes.CDLL(f"libcudart.so.{major}")
            lib.cudaMemcpyAsync.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            lib.cudaMemcpyAsync.restype = ctypes.c_int
            lib.cudaHostGetDevicePointer.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_uint,
            ]
            lib.cudaHostGetDevicePointer.restype = ctypes.c_int
            _CUDART = lib
        except (OSError, AttributeError):
            _CUDART = False
    return _CUDART or None


def _device_pointer(host_address: int) -> int | None:
    """The GPU's address of registered host memory (``cudaHostGetDevicePointer``)."""
    cudart = _cudart()
    if cudart is None:
        return None
    pointer = ctypes.c_void_p()
    rc = cudart.cudaHostGetDevicePointer(ctypes.byref(pointer), host_address, 0)
    return pointer.value if rc == 0 and pointer.value else None


H2D, D2H = 1, 2  # cudaMemcpyKind


class Memcpy:
    """``cudaMemcpyAsync`` between flat uint8 tensors at byte offsets, on the current stream.

    Straight through the CUDA runtime (ctypes, ~1-2 µs a call) where torch's runtime library
    is found, else torch's ``copy_`` on slices (~10 µs a call: slicing, dispatch, checks),
    which bounded a load of small pages by Python rather than PCIe (docs/benchmarks.md).
    Both are stream-ordered like any torch op on the current stream; the host side must be
    registered (the pool) for the copy to be asynchronous."""

    def __init__(self, runtime: bool = True) -> None:
        self.cudart = _cudart() if runtime else None

    def __call__(
        self,
        dst: torch.Tensor,
        dst_at: int,
        src: torch.Tensor,
        src_at: int,
        n: int,
        kind: int,
        stream: int,
    ) -> None:
        if self.cudart is None:
            dst[dst_at : dst_at + n].copy_(src[src_at : src_at + n], non_blocking=True)
            return
        rc = self.cudart.cudaMemcpyAsync(
            dst.data_ptr() + dst_at, src.data_ptr() + src_at, n, kind, stream
        )
        if rc:
            raise RuntimeError(f"cudaMemcpyAsync failed: CUDA error {rc}")


def device_words(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA int64 view of registered host memory ``host`` (uint8, contiguous), or None when
    the driver does not map it (or its size is not whole words)."""
    if host.numel() % WORD:
        return None
    pointer = _device_pointer(host.data_ptr())
    if pointer is None:
        return None
    return torch.as_tensor(_CudaArray(pointer, host.numel() // WORD), device="cuda")


def storage_words(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one allocation every layer lives in (``layers``: each layer's allocation as flat
    bytes), as int64 words; None when the layers do not share one (the kernel addresses
    every layer from one base: the copy engine runs) or it is not whole words."""
    if len({flat.data_ptr() for flat in layers}) != 1 or layers[0].numel() % WORD:
        return None
    return layers[0].view(torch.int64)


@dataclass
class Segments:
    """Per layer (rows) and segment (columns): pool word offset, KV word offset, words.
    Rows are padded with empty segments to one width."""

    pool: np.ndarray
    kv: np.ndarray
    length: np.ndarray

    @property
    def width(self) -> int:
        return int(self.pool.shape[1])


def segments(
    chunks: Sequence[ChunkCopy],
    layers: int,
    layer_bytes: int,
    page_bytes: int,
    layer_offsets: Sequence[int],
    block_stride: int,
) -> Segments | None:
    """Where every copied page of ``chunks`` lies in the pool and in the KV allocation, per
    layer, in words. ``layer_offsets[l]``: byte offset of layer ``l``'s block 0 in the KV
    allocation; ``block_stride``: bytes between blocks. None if anything is not whole words.

    A chunk in one extent (the usual case) is arithmetic over all its pages and layers at
    once; a chunk the allocator split maps each page through its extents, possibly into two
    segments."""
    if (page_bytes | layer_bytes | block_stride) % WORD or any(o % WORD for o in layer_offsets):
        return None
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(layers)]
    whole = [c for c in chunks if len(c.extents) == 1]
    pool_cols: list[np.ndarray] = []
    kv_cols: list[np.ndarray] = []
    if whole:
        starts = np.concatenate(
            [
                c.extents[0][0] + (c.first_block + np.arange(len(c.block_ids))) * page_bytes
                for c in whole
            ]
        ).astype(np.int64)
        blocks = np.concatenate([np.asarray(c.block_ids, dtype=np.int64) for c in whole])
        layer = np.arange(layers, dtype=np.int64)[:, None]
        pool_cols.append(starts[None, :] + layer * layer_bytes)
        kv_cols.append(np.asarray(layer_offsets, dtype=np.int64)[:, None] + blocks * block_stride)
    for chunk in (c for c in chunks if len(c.extents) != 1):
        for l_idx in range(layers):
            for i, block in enumerate(chunk.block_ids):
                start = l_idx * layer_bytes + (chunk.first_block + i) * page_bytes
                kv_at = layer_offsets[l_idx] + block * block_stride
                for offset, n in extent_pieces(chunk.extents, start, page_bytes):
                    rows[l_idx].append((offset, kv_at, n))
                    kv_at += n
    extra = max(len(r) for r in rows)
    pool = np.concatenate([*pool_cols, np.zeros((layers, extra), np.int64)], axis=1)
    kv = np.concatenate([*kv_cols, np.zeros((layers, extra), np.int64)], axis=1)
    length = np.zeros_like(pool)
    length[:, : pool.shape[1] - extra] = page_bytes
    for l_idx, row in enumerate(rows):
        at = pool.shape[1] - extra
        for j, (offset, kv_at, n) in enumerate(row):
            pool[l_idx, at + j], kv[l_idx, at + j], length[l_idx, at + j] = offset, kv_at, n
    if (pool % WORD).any() or (kv % WORD).any() or (length % WORD).any():
        return None
    return Segments(pool // WORD, kv // WORD, length // WORD)


class KernelPlan:
    """A job's segments on the device (uploaded on first use, on the copying stream), and
    the launch that copies one layer of them."""

    def __init__(self, work: Segments) -> None:
        self.work = work
        self.tiles = max(1, -(-int(work.length.max(initial=0)) // TILE))
        self._device: torch.Tensor | None = None

    def _offsets(self) -> torch.Tensor:
        if self._device is None:
            host = torch.from_numpy(np.stack([self.work.pool, self.work.kv, self.work.length]))
            self._device = host.pin_memory().to("cuda", non_blocking=True)
        return self._device

    def copy(self, layer: int, src: torch.Tensor, dst: torch.Tensor, load: bool) -> None:
        """Layer ``layer``: pool -> KV when ``load``, else KV -> pool; ``src``/``dst`` are
        the pool's and the KV allocation's words, in that direction's order."""
        if not self.work.width:
            return
        offsets = self._offsets()
        pool, kv, length = offsets[0, layer], offsets[1, layer], offsets[2, layer]
        src_off, dst_off = (pool, kv) if load else (kv, pool)
        grid = (self.work.width * self.tiles,)
        _copy_segments[grid](src, dst, src_off, dst_off, length, self.tiles, BLOCK=TILE)


def kernel_plan(
    chunks: Sequence[ChunkCopy],
    geometry: KvGeometry,
    layer_offsets: Sequence[int],
    block_stride: int,
) -> KernelPlan | None:
    work = segments(
        chunks,
        geometry.num_layers,
        geometry.layer_bytes,
        geometry.page_bytes,
        layer_offsets,
        block_stride,
    )
    return KernelPlan(work) if work is not None else None
