"""vLLM 0.32's KV cache tensors as its CUDA attention backends get them, rebuilt without vLLM.

What ``KVConnector.register_kv_caches`` receives on a GPU: vLLM allocates one int8 buffer for
the whole KV cache and hands the connector one view per attention layer, logically
``[B, H, N, C]`` (blocks, head slots, tokens of a block, content: K then V of one head at one
token, or MLA's latent), with strides set by the resolved ``KVCacheLayout`` (a permutation of
``[L, B, H, N, C]``). FlashAttention, Triton and FlashInfer on Hopper take vLLM's default
``LBNHC`` (each layer a region, tokens outside heads: "NHD"); FlashInfer on Blackwell and
NIXL-style transfers ``LBHNC`` ("HND"); a connector asking for cross-layer blocks gets
``BLNHC``/``BLHNC`` (one block of every layer side by side). Hybrid models with vLLM's hybrid
allocator get one set of views per KV cache group, the groups aliasing the same bytes (a block
id belongs to one group at a time). A backend whose kernel block is smaller than the manager's
block (``--block-size 32`` under a 16-token kernel) sees ``ratio`` kernel blocks per block.

The GPU checks (``tests/gpu``) and ``kvtier bench kv-copy --device cuda`` run on machines
without vLLM's CUDA build, so this module mirrors the arithmetic of vLLM's
``compute_layout_strides``, ``create_kv_cache_views`` (``vllm/v1/kv_cache_interface.py``) and
``get_kv_cache_config_from_groups`` (``vllm/v1/core/kv_cache_utils.py``) for uniform page
sizes without padding. ``tests/unit/connector/test_kv_layouts.py`` holds every case below to
vLLM's real functions, so a vLLM upgrade that moves a byte fails there, not silently on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# KVCacheLayout: a layout's value maps logical axes [L, B, H, N, C] to physical order
# (outermost first), as in vllm/v1/kv_cache_layout.py.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B = 0, 1


def block_outermost(layout: str) -> bool:
    return LAYOUTS[layout][0] == _B


@dataclass(frozen=True)
class PageSpec:
    """One attention layer's page of one block, as vLLM's ``AttentionSpec`` sizes it.

    ``content_bytes`` is C in bytes: ``(head_size + head_size_v) * dtype size`` for K|V
    attention, the latent's bytes for MLA (``head_size_v = 0``), or a packed per-token blob
    (``fp8_ds_mla``: 656 bytes)."""

    block_size: int
    num_heads: int
    content_bytes: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.block_size * self.content_bytes


@dataclass(frozen=True)
class Group:
    """One KV cache group: its layers share a block table."""

    spec: PageSpec
    layers: tuple[str, ...]
    kind: str = "full"  # "full", "sliding_window" (vLLM's spec class, for the CPU check)
    sliding_window: int | None = None


@dataclass(frozen=True)
class CacheCase:
    """A model's KV cache under one CUDA attention backend: what vLLM allocates."""

    name: str
    backend: str  # vLLM's backend name, for people (and the CPU check's backend class)
    layout: str
    groups: tuple[Group, ...]
    kernel_block_size: int | None = None  # None: the manager's block size
    mla: bool = False
    note: str = ""

    @property
    def page_bytes(self) -> int:
        return self.groups[0].spec.page_bytes


@dataclass(frozen=True)
class TensorPlacement:
    """vLLM's ``KVCacheTensor``: layer ``layers[l]``'s page of block ``b`` starts at
    ``offset + l * layer_stride + b * block_stride`` bytes into the one allocation."""

    spec: PageSpec  # the layers' page (kvtier's addition: vLLM keeps it on the group)
    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


def _strides(
    layout: str, shape: tuple[int, ...], layer_stride: int | None, block_stride: int | None
) -> tuple[int, ...]:
    """Byte strides in logical [L, B, H, N, C] order (``compute_layout_strides``); a given
    layer or block stride is kept, the rest are packed inside out."""
    fixed = (layer_stride, block_stride, None, None, None)
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def _shape_bytes(spec: PageSpec, num_blocks: int, kernel_block_size: int | None) -> tuple:
    """The 4D ``(B, H, N, C bytes)`` shape (``compute_layer_kv_cache_shape_bytes``)."""
    bs = kernel_block_size or spec.block_size
    return (num_blocks * (spec.block_size // bs), spec.num_heads, bs, spec.content_bytes)


def placements(case: CacheCase, num_blocks: int) -> list[TensorPlacement]:
    """Where each group's layers live (``get_kv_cache_config_from_groups``, uniform pages)."""
    pages = {g.spec.page_bytes for g in case.groups}
    if len(pages) != 1:
        raise ValueError("the mirror covers uniform page sizes only")
    bytes_per_block = max(len(g.layers) * g.spec.page_bytes for g in case.groups)
    interleaved = bytes_per_block if block_outermost(case.layout) else None
    out = []
    for group in case.groups:  # groups alias from byte 0
        shape = (len(group.layers), *_shape_bytes(group.spec, num_blocks, None))
        layer_stride, block_stride = _strides(case.layout, shape, None, interleaved)[:2]
        out.append(
            TensorPlacement(
                group.spec, bytes_per_block * num_blocks, group.layers, layer_stride, block_stride
            )
        )
    return out


def layer_views(
    buffer: torch.Tensor, case: CacheCase, placement: TensorPlacement, num_blocks: int
) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer of ``placement`` (``create_kv_cache_views``)."""
    spec = placement.spec
    shape = _shape_bytes(spec, num_blocks, case.kernel_block_size)
    block_stride = placement.block_stride
    ratio = shape[0] // num_blocks
    if ratio > 1:
        if block_stride != spec.page_bytes:
            raise ValueError(f"{case.layout} cannot split a block into {ratio} kernel blocks")
        block_stride //= ratio
    logical = (len(placement.layers), *shape)
    strides = _strides(case.layout, logical, placement.layer_stride, block_stride)
    view_5d = torch.as_strided(buffer, logical, strides, buffer.storage_offset() + placement.offset)
    return {name: view_5d[i].view(spec.dtype) for i, name in enumerate(placement.layers)}


def allocate(
    case: CacheCase, num_blocks: int, device: torch.device | str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The backing int8 buffer (zeroed, as vLLM's) and every layer's view."""
    tensors = placements(case, num_blocks)
    buffer = torch.zeros(tensors[0].size, dtype=torch.int8, device=device)
    views: dict[str, torch.Tensor] = {}
    for placement in tensors:
        views.update(layer_views(buffer, case, placement, num_blocks))
    return buffer, views


# -- the cases the GPU checks run ------------------------------------------------------------


def _layers(n: int, prefix: str = "model.layers", start: int = 0, step: int = 1) -> tuple:
    return tuple(f"{prefix}.{i}.self_attn.attn" for i in range(start, n, step))


def attention_spec(
    block_size: int, kv_heads: int, head_size: int, dtype: torch.dtype = torch.bfloat16
) -> PageSpec:
    """K|V attention: C = K and V of one head at one token."""
    item = torch.empty((), dtype=dtype).element_size()
    return PageSpec(block_size, kv_heads, 2 * head_size * item, dtype)


def cases(layers: int = 4, kv_heads: int = 8, head_size: int = 128) -> list[CacheCase]:
    """Every layout kvtier's worker copies on CUDA, for one attention geometry."""
    bf16 = attention_spec(16, kv_heads, head_size)
    fp8 = attention_spec(16, kv_heads, head_size, torch.uint8)  # --kv-cache-dtype fp8
    full = (Group(bf16, _layers(layers)),)
    return [
        CacheCase("flash-attn", "FLASH_ATTN", "LBNHC", full, note="vLLM's default on CUDA"),
        CacheCase("flashinfer-hnd", "FLASHINFER", "LBHNC", full, note="Blackwell, NIXL"),
        CacheCase("cross-layer-nhd", "FLASH_ATTN", "BLNHC", full, note="block-outermost"),
        CacheCase("cross-layer-hnd", "FLASHINFER", "BLHNC", full, note="block-outermost"),
        CacheCase("fp8-kv", "FLASH_ATTN", "LBNHC", (Group(fp8, _layers(layers)),)),
        CacheCase(
            "kernel-split",
            "FLASH_ATTN",
            "LBNHC",
            (Group(attention_spec(32, kv_heads, head_size), _layers(layers)),),
            kernel_block_size=16,
            note="32-token blocks, 16-token kernel blocks",
        ),
        CacheCase(
            "mla",
            "FLASHMLA",
            "LBNHC",
            (Group(PageSpec(64, 1, 576 * 2, torch.bfloat16), _layers(layers)),),
            mla=True,
            note="DeepSeek latent: 512 + 64 rope, bf16",
        ),
        CacheCase(
            "mla-fp8-ds",
            "FLASHMLA_SPARSE",
            "LBNHC",
            (Group(PageSpec(64, 1, 656, torch.uint8), _layers(layers)),),
            mla=True,
            note="fp8_ds_mla: 656-byte packed latent per token",
        ),
        CacheCase(
            "hybrid",
            "FLASH_ATTN",
            "LBNHC",
            (
                Group(bf16, _layers(2 * layers, start=0, step=2)),
                Group(
                    bf16,
                    _layers(2 * layers, start=1, step=2),
                    kind="sliding_window",
                    sliding_window=128,
                ),
            ),
            note="gpt-oss-style: full and sliding-window groups alias one buffer",
        ),
    ]


def case_named(name: str, **geometry: int) -> CacheCase:
    for case in cases(**geometry):
        if case.name == name:
            return case
    raise KeyError(f"no KV layout case {name!r}; known: {[c.name for c in cases()]}")
