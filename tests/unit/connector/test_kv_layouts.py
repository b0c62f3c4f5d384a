"""vLLM 0.32's KV cache layouts, as its CUDA backends get them, through the worker's copies.

Two promises, on CPU tensors with exactly the strides a GPU gets:
- ``kvtier.bench.micro.kv_layouts`` (the mirror tests/gpu and ``kvtier bench kv-copy --device cuda``
  use where vLLM cannot be installed) builds the same views as vLLM's own allocation code;
- the worker saves and loads every block-compact layout byte-exactly (the old ``page_rows``
  refused vLLM's CUDA default, LBNHC, at ``register_kv_caches``) and refuses, with the way
  out, the layouts that split a page.

(The shim of vLLM types the GPU tests use: tests/integration/test_vllm_shim.py.)
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvtier.bench.micro import kv_layouts
from kvtier.connector import cuda_copy, paged_kv, sync_loads
from kvtier.connector import worker as worker_module
from kvtier.connector.paged_kv import UnsupportedLayout

from support.kv_rig import KvRig, damaged_chunk_is_named, round_trip, saved_for_loading

CASES = kv_layouts.cases(layers=3, kv_heads=2, head_size=8)


def _vllm_spec(case: kv_layouts.CacheCase, group: kv_layouts.Group):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.spec
    if case.mla:  # what vLLM's MLAAttention.get_kv_cache_spec builds
        packed = spec.dtype == torch.uint8
        return MLAAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=1,
            head_size=576,
            dtype=spec.dtype,
            cache_dtype_str="fp8_ds_mla" if packed else "auto",
            state_content_bytes=656 if packed else None,
        )
    head_size = spec.content_bytes // 2 // torch.empty((), dtype=spec.dtype).element_size()
    common = dict(block_size=spec.block_size, num_kv_heads=spec.num_heads, head_size=head_size)
    if group.kind == "sliding_window":
        return SlidingWindowSpec(**common, dtype=spec.dtype, sliding_window=group.sliding_window)
    return FullAttentionSpec(**common, dtype=spec.dtype)


def _vllm_views(case: kv_layouts.CacheCase, num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's own: the KV cache config for these groups, then the allocation."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[case.layout]
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=num_blocks,
        prefix_cache_retention_interval=None,
    )
    config = SimpleNamespace(
        cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None)
    )
    groups = [KVCacheGroupSpec(list(g.layers), _vllm_spec(case, g)) for g in case.groups]
    for group, mine in zip(groups, case.groups, strict=True):
        assert group.kv_cache_spec.page_size_bytes == mine.spec.page_bytes
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    kernel = [case.kernel_block_size or g.spec.block_size for g in case.groups]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("num_blocks", [7, 16])
def test_the_mirror_builds_vllms_own_views(case: kv_layouts.CacheCase, num_blocks: int) -> None:
    theirs = _vllm_views(case, num_blocks)
    _, ours = kv_layouts.allocate(case, num_blocks, "cpu")
    assert set(ours) == set(theirs)
    for name, view in theirs.items():
        assert _shape(ours[name]) == _shape(view), name
    # one allocation, groups aliasing it as vLLM's do
    storages = {v.untyped_storage().data_ptr() for v in theirs.values()}
    assert len(storages) == 1


def test_the_cases_name_the_layouts_and_blocks_vllms_cuda_backends_choose() -> None:
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    by_name = {c.name: c for c in CASES}
    for backend, case in ((FlashAttentionBackend, "flash-attn"), (FlashMLABackend, "mla")):
        first = get_supported_kv_cache_layouts([backend])[0]
        assert first.name == by_name[case].layout == "LBNHC"
    mla_block = by_name["mla"].groups[0].spec.block_size
    assert FlashMLABackend.get_supported_kernel_block_sizes() == [mla_block]
    assert FlashAttentionBackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    assert by_name["kernel-split"].kernel_block_size == 16


def _emulated_kernel(self: cuda_copy.KernelPlan, layer: int, src, dst, load: bool) -> None:
    """What the copy kernel does with a layer's segments, in numpy: the plan's arithmetic
    is checked everywhere, the kernel itself on a GPU (tests/gpu)."""
    _emulated_kernel.calls += 1  # type: ignore[attr-defined]
    work = self.work
    src_off, dst_off = (work.pool, work.kv) if load else (work.kv, work.pool)
    src_words, dst_words = src.numpy(), dst.numpy()
    for s, d, n in zip(src_off[layer], dst_off[layer], work.length[layer], strict=True):
        dst_words[d : d + n] = src_words[s : s + n]


_emulated_kernel.calls = 0  # type: ignore[attr-defined]


class _MappedPool(paged_kv.PoolView):
    """A pool whose 'device view' is its host memory, for the emulated kernel."""

    def __init__(self, segment, pin: bool) -> None:
        super().__init__(segment, pin=False)
        self.device_words = self.tensor.view(torch.int64)


def _emulate_cuda(rig: KvRig, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's plans on host tensors, its streams the host's no-ops."""
    paged = rig.worker.kv
    assert paged is not None
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    direct = 2 * rig.geometry.page_bytes if path == "memcpy-direct" else 1 << 40
    monkeypatch.setattr(paged_kv, "DIRECT_MIN_BYTES", direct)
    paged.is_cuda = True
    paged.wide_rows = [paged_kv._wide(rows) for rows in paged.rows]
    if path == "kernel":
        monkeypatch.setattr(cuda_copy.KernelPlan, "copy", _emulated_kernel)
        monkeypatch.setattr(worker_module, "PoolView", _MappedPool)
        paged.kv_words = cuda_copy.storage_words(paged.kv_flat)
        paged.use_kernel = True


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("load", ["sync", "async"])
@pytest.mark.parametrize("path", ["host", "memcpy-staged", "memcpy-direct", "kernel"])
def test_every_block_compact_layout_round_trips_through_the_pool(
    case: kv_layouts.CacheCase, load: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``host``: the CPU backend's copies. The others are the CUDA path's plans on host
    tensors, its streams replaced by the host's no-ops, so their bytes are checked on every
    machine (tests/gpu runs them on a GPU with its streams): ``memcpy-*``, runs straight
    between pool and pages or everything through the staging buffer and index kernels on
    wide elements; ``kernel``, the copy kernel's segments applied by a numpy stand-in."""
    rig = KvRig(case, "cpu", num_blocks=48)
    try:
        if path != "host":
            _emulate_cuda(rig, path, monkeypatch)
        calls = _emulated_kernel.calls  # type: ignore[attr-defined]
        round_trip(rig, is_async=load == "async")
        if path == "kernel":  # every layer's save and load went through the kernel
            assert _emulated_kernel.calls - calls == 2 * rig.geometry.num_layers  # type: ignore[attr-defined]
    finally:
        rig.close()


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_layouts_that_split_a_page_are_refused_with_the_way_out(layout: str) -> None:
    case = dataclasses.replace(kv_layouts.case_named("flash-attn"), layout=layout)
    with pytest.raises(UnsupportedLayout, match="VLLM_KV_CACHE_LAYOUT=LBNHC"):
        KvRig(case, "cpu", num_blocks=8)


@pytest.mark.parametrize("threads", [None, 1, 3])
@pytest.mark.parametrize("load", ["sync", "async"])
@pytest.mark.parametrize("path", ["host", "memcpy-direct", "memcpy-direct-layerwise"])
def test_a_damaged_chunk_fails_its_load_and_is_named(
    threads: int | None, load: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify_threads``: None is the default (one thread on a CPU engine); 3 checksums the
    chunks side by side, as a CUDA worker does. ``memcpy-direct``: the CUDA path's plans on
    host tensors (tests/gpu runs it with real streams); ``-layerwise``: a sync load's sums
    taken as each layer's copies end (``load_sums.LayerwiseSums``)."""
    rig = KvRig(CASES[0], "cpu", num_blocks=48)
    try:
        if path != "host":
            _emulate_cuda(rig, "memcpy-direct", monkeypatch)
        if path.endswith("layerwise"):  # the test's chunks are small: follow the copies anyway
            monkeypatch.setattr(sync_loads, "LAYERWISE_MIN_SLICE_BYTES", 0)
        rig.worker.config = rig.worker.config.model_copy(update={"verify_threads": threads})
        if path == "host":
            assert rig.worker.verify_threads() == (threads or 1)
        damaged_chunk_is_named(rig, is_async=load == "async")
    finally:
        rig.close()


@pytest.mark.parametrize("fault", ["event", "hash"])
def test_a_layer_wise_checksum_that_fails_fails_its_load(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA path (emulated): the event after a layer's copies cannot be made, or the
    hashing thread fails: the load fails (every target block recomputed), nothing hangs."""
    from kvtier.connector import load_sums

    monkeypatch.setattr(sync_loads, "LAYERWISE_MIN_SLICE_BYTES", 0)
    rig = KvRig(CASES[0], "cpu", num_blocks=48)
    try:
        _emulate_cuda(rig, "memcpy-direct", monkeypatch)
        paged = rig.worker.kv
        assert paged is not None
        loads, target = saved_for_loading(rig, 2)
        if fault == "event":

            def no_event() -> None:
                raise RuntimeError("CUDA error: out of memory")

            monkeypatch.setattr(paged.ordering, "loads_issued", no_event)
        else:

            def broken(self: object, part: object) -> None:
                raise RuntimeError("hashing failed")

            monkeypatch.setattr(load_sums.LayerwiseSums, "_follow", broken)
        result = rig.step(loads=[rig.load_job(loads, is_async=False)])
        assert result.load_errors == set(target)
        assert result.out.load_failed == {"req-load": {0}} and not result.out.loaded
    finally:
        rig.close()
