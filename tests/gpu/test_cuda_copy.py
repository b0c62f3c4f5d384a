"""The worker's CUDA copy path on a GPU: vLLM 0.32's CUDA KV layouts in device memory, a node
pool segment registered with CUDA, the load and save side streams and per-layer events as
the connector drives them in vLLM's order of hooks.

- Every layout round-trips byte-exactly (GPU -> pool -> other block ids), sync (layer-wise)
  and async, and each layer's attention, queued on the compute stream right after
  ``wait_for_layer_load``, reads exactly the loaded pages while later layers still copy.
- Ordering, with CUDA graphs replaying on the compute stream while a load is in flight:
  a load lands after what the model runner queued before the step (vLLM zeroes newly
  allocated blocks there), and a layer's attention (a graph replay) waits for its layer's
  copy. Each has a control that removes the ordering and shows the bytes torn, so the checks
  can fail.

Needs a CUDA device; skipped elsewhere (the CPU side of the same copies:
tests/unit/connector/test_kv_copy.py, tests/unit/connector/test_kv_layouts.py). Run on a GPU
machine without vLLM: ``pytest tests/gpu --confcutdir tests/gpu`` (conftest.py stands the vLLM
shim in for vLLM).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.bench.micro import kv_layouts
from kvtier.connector import cuda_copy, paged_kv
from kvtier.connector.streams import DeviceOrdering

from support.kv_rig import KvRig, damaged_chunk_is_named, round_trip, same_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (the pinned pool, side streams and events run only there)",
    ),
]

CASES = kv_layouts.cases(layers=4, kv_heads=4, head_size=128)
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM spinning: far longer than any copy here


@pytest.fixture
def compute() -> Iterator[torch.cuda.Stream]:
    """The model runner's stream: not the default one, as in vLLM."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.synchronize()


def _rig(case: kv_layouts.CacheCase, **kwargs: int) -> KvRig:
    return KvRig(case, "cuda", num_blocks=kwargs.pop("num_blocks", 96), **kwargs)


PATHS = ["kernel", "memcpy-staged", "memcpy-direct", "torch-copy"]


def _use(rig: KvRig, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel``: one copy kernel per layer over the pool's device mapping; ``memcpy-*``:
    the copy engine, runs of consecutive block ids going pool <-> pages directly (one
    cudaMemcpyAsync each through the CUDA runtime) or everything through the staging buffer;
    ``torch-copy``: with torch's ``copy_`` (where the runtime is not found)."""
    paged = rig.worker.kv
    assert paged is not None
    if path == "kernel":
        assert paged.kv_words is not None, "no copy kernel on this GPU"
    else:
        assert paged.memcpy.cudart is not None, "the CUDA runtime was not found"
    paged.use_kernel = path == "kernel"
    if path == "torch-copy":
        paged.memcpy = cuda_copy.Memcpy(runtime=False)
    direct = 1 << 40 if path.endswith("staged") else 2 * rig.geometry.page_bytes
    monkeypatch.setattr(paged_kv, "DIRECT_MIN_BYTES", direct)


@pytest.mark.parametrize("load", ["sync", "async"])
def test_a_damaged_chunk_fails_its_load_and_is_named_by_the_parallel_checksums(
    load: str, compute: torch.cuda.Stream
) -> None:
    """On CUDA a load's chunks are checksummed side by side (``verify_threads`` defaults to
    half the cores, up to 8), after the copy engine moved them: the damaged one is named."""
    rig = _rig(CASES[0])
    try:
        assert rig.worker.verify_threads() > 1 or (os.cpu_count() or 1) < 4
        damaged_chunk_is_named(rig, is_async=load == "async")
    finally:
        rig.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("load", ["sync", "async"])
@pytest.mark.parametrize("path", PATHS)
def test_every_layout_round_trips_through_the_registered_pool(
    case: kv_layouts.CacheCase,
    load: str,
    path: str,
    compute: torch.cuda.Stream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = _rig(case)
    try:
        _use(rig, path, monkeypatch)
        round_trip(rig, is_async=load == "async")
        pools = rig.worker._pools.values()
        assert pools and all(p.pinned for p in pools)
        if path == "kernel":
            assert all(p.device_words is not None for p in pools)
    finally:
        rig.close()


def _graph(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph (after one warm-up run on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _saved(rig: KvRig, source: list[int]) -> list:
    chunks = rig.chunks(source)
    rig.step(saves=[rig.save_job(chunks)])
    return rig.with_checksums(chunks)


def _retarget(rig: KvRig, chunks: list, target: list[int]) -> list:
    per = rig.geometry.blocks_per_chunk
    return [
        type(c)(c.extents, c.checksum, c.first_block, tuple(target[i * per : (i + 1) * per]), c.key)
        for i, c in enumerate(chunks)
    ]


def _load_after_zeroing(rig: KvRig, target: list[int], chunks: list) -> bool:
    """vLLM zeroes newly allocated blocks on the compute stream before ``start_load_kv``
    (``KVBlockZeroer``): a graph that spins, then zeroes the load's target blocks, replays
    there; then the step loads into them. True when every target page holds the loaded
    bytes."""
    index = torch.tensor(target, device="cuda")
    views = [rig.views[name] for name in rig.geometry.layer_names]

    def zero_new_blocks() -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        for view in views:
            view.index_fill_(0, index, 0)

    graph = _graph(zero_new_blocks)
    before = rig.snapshot()
    graph.replay()
    result = rig.step(loads=[rig.load_job(chunks, is_async=False, verify=False)])
    assert not result.load_errors
    after = rig.snapshot()
    return all(
        rig.page(after, layer, dst) == rig.page(before, layer, src)
        for layer in range(rig.geometry.num_layers)
        for src, dst in zip(SOURCE, target, strict=True)
    )


SOURCE = list(range(4, 12))
TARGET = list(range(40, 48))


@pytest.mark.parametrize("path", ["kernel", "memcpy-direct", "memcpy-staged"])
def test_a_load_lands_after_what_the_forward_queued_before_the_step(
    path: str, compute: torch.cuda.Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = _rig(kv_layouts.case_named("flash-attn", layers=4, kv_heads=4, head_size=128))
    try:
        _use(rig, path, monkeypatch)
        chunks = _retarget(rig, _saved(rig, SOURCE), TARGET)
        assert _load_after_zeroing(rig, TARGET, chunks)
    finally:
        rig.close()


@pytest.mark.parametrize("path", ["kernel", "memcpy-direct", "memcpy-staged"])
def test_control_without_the_steps_wait_the_zeroing_wipes_the_load(
    path: str, compute: torch.cuda.Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: drop the load stream's wait for the compute stream and the
    zeroing, still spinning when the copy finishes, lands on top of it."""

    def bind_without_waiting(self: DeviceOrdering) -> None:
        self.compute = torch.cuda.current_stream(self.device)

    monkeypatch.setattr(DeviceOrdering, "bind_compute", bind_without_waiting)
    rig = _rig(kv_layouts.case_named("flash-attn", layers=4, kv_heads=4, head_size=128))
    try:
        _use(rig, path, monkeypatch)
        chunks = _retarget(rig, _saved(rig, SOURCE), TARGET)
        assert not _load_after_zeroing(rig, TARGET, chunks)
    finally:
        rig.close()


def _attention_graphs_during_a_slow_load(rig: KvRig) -> tuple[bool, bool]:
    """Each layer's attention is a CUDA graph replayed right after ``wait_for_layer_load``
    (vLLM's piecewise graphs put attention between graph pieces; here the piece itself reads
    the KV) and writes this step's new token into a block of its own. The load stream is held
    back by a spinning kernel, so every replay is queued while its layer's copy is in flight.
    Returns (every layer read the loaded pages, the graph's own writes landed)."""
    geo = rig.geometry
    chunks = _retarget(rig, _saved(rig, SOURCE), TARGET)
    new_block = 60
    outputs = [torch.empty_like(rig.views[name]) for name in geo.layer_names]

    def attention(layer: int) -> Callable[[], None]:
        view, out = rig.views[geo.layer_names[layer]], outputs[layer]

        def run() -> None:
            out.copy_(view)  # reads every page of the layer, the loaded ones among them
            view[new_block].fill_(layer + 1)  # this step's KV, into a block of its own

        return run

    graphs = [_graph(attention(layer)) for layer in range(geo.num_layers)]
    before = rig.snapshot()
    with torch.cuda.stream(rig.worker.kv.ordering.load_stream):  # a slow link, say
        torch.cuda._sleep(SLEEP_CYCLES)
    rig.step(
        loads=[rig.load_job(chunks, is_async=False, verify=False)],
        layer_compute=lambda layer: graphs[layer].replay(),
    )
    expected = rig.expect_loaded(before, before, list(zip(SOURCE, TARGET, strict=True)))
    views = rig.views_over(expected)
    read_loaded = all(
        same_bytes(outputs[layer].cpu(), views[name]) for layer, name in enumerate(geo.layer_names)
    )
    wrote = True
    after = rig.snapshot()
    for layer, name in enumerate(geo.layer_names):
        page = rig.page(after, layer, new_block)
        fill = torch.full_like(rig.views[name][new_block], layer + 1).cpu().contiguous()
        wrote = wrote and page == fill.view(torch.uint8).numpy().tobytes()
    return read_loaded, wrote


@pytest.mark.parametrize("path", ["kernel", "memcpy-direct", "memcpy-staged"])
def test_attention_graphs_replayed_during_a_load_read_only_loaded_pages(
    path: str, compute: torch.cuda.Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = _rig(kv_layouts.case_named("flash-attn", layers=4, kv_heads=4, head_size=128))
    try:
        _use(rig, path, monkeypatch)
        read_loaded, wrote = _attention_graphs_during_a_slow_load(rig)
        assert read_loaded and wrote
    finally:
        rig.close()


@pytest.mark.parametrize("path", ["kernel", "memcpy-direct", "memcpy-staged"])
def test_control_without_the_layer_events_attention_reads_torn_pages(
    path: str, compute: torch.cuda.Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: without ``wait_layer``'s event the replays run before the
    held-back copies."""
    monkeypatch.setattr(DeviceOrdering, "wait_layer", lambda self, layer: None)
    rig = _rig(kv_layouts.case_named("flash-attn", layers=4, kv_heads=4, head_size=128))
    try:
        _use(rig, path, monkeypatch)
        read_loaded, _ = _attention_graphs_during_a_slow_load(rig)
        assert not read_loaded
    finally:
        rig.close()


@pytest.mark.parametrize("path", ["memcpy-staged", "memcpy-direct", "torch-copy"])
def test_a_hybrid_chunk_round_trips_group_by_group(
    path: str, compute: torch.cuda.Stream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two KV cache groups (full attention keeping a chunk's 4 blocks, a sliding window
    keeping its last 2): each layer copies its own group's blocks to its own place in the
    chunk, on the copy engine (the kernel path is for one full-attention layout only)."""
    from kvtier.connector.layout import FULL, SLIDING_WINDOW, GroupGeometry, KvGeometry
    from kvtier.connector.metadata import ChunkCopy
    from kvtier.store.client.shm import SharedSegment

    shape = (64, 2, 4, 32, 128)  # blocks, K|V, heads, tokens, head_size
    page = 2 * 4 * 32 * 128 * 2
    groups = (
        GroupGeometry(FULL, ("f0", "f1"), 4, source=0),
        GroupGeometry(SLIDING_WINDOW, ("w0",), 2, 64, source=1),
    )
    geo = KvGeometry(("f0", "f1", "w0"), 32, page, 128, "t", groups)
    gen = torch.Generator(device="cuda").manual_seed(3)
    source = {
        n: torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        for n in geo.layer_names
    }
    target = {n: torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for n in geo.layer_names}
    segment = SharedSegment.create(f"kvtier-test-gpu-groups-{os.getpid()}", 8 << 20)
    pool = paged_kv.PoolView(segment, pin=True)
    try:
        saver, loader = paged_kv.PagedKV(source, geo), paged_kv.PagedKV(target, geo)
        for paged in (saver, loader):
            paged.use_kernel = False
            if path == "torch-copy":
                paged.memcpy = cuda_copy.Memcpy(runtime=False)
        direct = 1 << 40 if path.endswith("staged") else page
        monkeypatch.setattr(paged_kv, "DIRECT_MIN_BYTES", direct)
        extents = ((1 << 20, geo.chunk_bytes),)
        saves = [
            ChunkCopy(extents, 0, 0, (1, 2, 3, 4), b"k", 0),
            ChunkCopy(extents, 0, 0, (9, 8), b"k", 1),
        ]
        saver.bind_compute()
        plan = saver.plan(saves)
        for layer in range(geo.num_layers):
            saver.save_layer(layer, pool, plan)
        saver.finish_saves()
        loads = [
            ChunkCopy(extents, 0, 0, (11, 12, 13, 14), b"k", 0),
            ChunkCopy(extents, 0, 0, (20, 21), b"k", 1),
        ]
        loader.bind_compute()
        plan = loader.plan(loads)
        for layer in range(geo.num_layers):
            loader.load_layer(layer, pool, plan)
            loader.wait_layer(layer)
        loader.finish_loads()
        torch.cuda.synchronize()
        for name in ("f0", "f1"):
            assert torch.equal(target[name][11:15], source[name][1:5])
        assert torch.equal(target["w0"][20], source["w0"][9])
        assert torch.equal(target["w0"][21], source["w0"][8])
        assert not target["f0"][20:22].any() and not target["w0"][11:15].any()
    finally:
        pool.close()
        segment.close()
        segment.unlink()
