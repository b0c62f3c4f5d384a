"""Byte-exact copies between a real shared pool segment and paged KV tensors (CPU path).

The connector's worker copies pages with run-coalesced slice copies on CPU; these tests pin
down that every page lands where the chunk layout says, for consecutive and scattered block
ids, chunks split across pool extents, and partial chunks (a run starting mid-chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import pytest
import torch

from kvtier.bench.micro import kv_layouts
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.paged_kv import PagedKV, PoolView, block_runs
from kvtier.connector.streams import DeviceOrdering
from kvtier.store.client.shm import SharedSegment

from support.kv_rig import KvRig

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
        saver.save_layer(layer, pool, saver.plan([chunk_out]))
    # The pool holds, layer after layer, the chunk's pages in order.
    pool_bytes = b"".join(segment.read([e]) for e in extents)
    for layer in range(LAYERS):
        for i, block in enumerate(source_blocks):
            at = layer * geo.layer_bytes + i * PAGE_BYTES
            assert pool_bytes[at : at + PAGE_BYTES] == _page(source, layer, block)

    # Load the last three pages of the chunk (a run starting mid-chunk), then the first one.
    tail = ChunkCopy(extents, 0, 1, target_blocks[1:])
    head = ChunkCopy(extents, 0, 0, target_blocks[:1])
    plan = loader.plan([tail, head])
    for layer in range(LAYERS):
        loader.load_layer(layer, pool, plan)
    for layer in range(LAYERS):
        for src_block, dst_block in zip(source_blocks, target_blocks, strict=True):
            assert _page(target, layer, dst_block) == _page(source, layer, src_block)
    untouched = set(range(NUM_BLOCKS)) - set(target_blocks)
    zero_page = bytes(PAGE_BYTES)
    assert all(_page(target, layer, b) == zero_page for layer in range(LAYERS) for b in untouched)


class _Recorder:
    """Plays torch.cuda: streams are names given in creation order, the 'current' stream is
    per thread."""

    def __init__(self, names: tuple[str, ...] = ("load", "save", "scatter")) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.local = threading.local()
        recorder = self
        fresh = iter(names)

        class Stream:
            def __init__(self, device: object = None, name: str | None = None) -> None:
                self.name = name or next(fresh)

            def wait_stream(self, other: Stream) -> None:
                recorder.calls.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: object) -> None:
                recorder.calls.append(("wait_event", self.name))

            def synchronize(self) -> None:
                recorder.calls.append(("synchronize", self.name))

        class Event:
            def record(self, stream: Stream) -> None:
                recorder.calls.append(("record", stream.name))

        self.Stream, self.Event = Stream, Event

    def current_stream(self, device: object = None):
        return self.Stream(name=getattr(self.local, "stream", "default"))

    def stream(self, stream: object):
        return contextlib.nullcontext()


def test_loads_wait_once_for_the_model_runners_stream_then_overlap_the_forward() -> None:
    """Layer-wise loads are issued from a thread whose current stream is the default one; the
    copies must still start after what the model runner's stream queued before the step, and
    a later layer's copy must not wait for this step's forward (which waits for the copies):
    one wait per step, then events per layer."""
    cuda = _Recorder()
    ordering = DeviceOrdering("cuda:0", num_layers=2, backend=cuda)
    cuda.local.stream = "forward"  # vLLM's model runner computes on a non-default stream
    ordering.bind_compute()

    def load_thread() -> None:  # current stream: "default"
        for layer in range(2):
            with ordering.loading():
                pass
            ordering.layer_loaded(layer)

    thread = threading.Thread(target=load_thread)
    thread.start()
    thread.join()
    ordering.wait_layer(0)
    ordering.wait_layer(1)
    assert cuda.calls == [
        ("wait_stream", "load", "forward"),
        ("record", "load"),
        ("record", "load"),
        ("wait_event", "forward"),
        ("wait_event", "forward"),
    ]


def test_saves_wait_for_the_forward_so_far_and_for_issued_loads() -> None:
    cuda = _Recorder()
    ordering = DeviceOrdering("cuda:0", num_layers=2, backend=cuda)
    cuda.local.stream = "forward"
    ordering.bind_compute()
    cuda.calls.clear()
    with ordering.saving():
        pass
    assert cuda.calls == [
        ("wait_stream", "save", "forward"),
        ("wait_stream", "save", "load"),
        ("wait_stream", "save", "scatter"),
    ]


def test_a_layers_scatter_follows_its_uploads_and_the_layer_event_follows_the_scatter() -> None:
    """Staged pages are scattered on their own stream so the next layer's uploads overlap;
    the layer's attention must then wait for the scatter, not only the uploads."""
    cuda = _Recorder(("load", "save", "scatter"))
    ordering = DeviceOrdering("cuda:0", num_layers=1, backend=cuda)
    cuda.local.stream = "forward"
    ordering.bind_compute()
    cuda.calls.clear()
    with ordering.scattering():
        pass
    ordering.layer_loaded(0, scattered=True)
    ordering.wait_layer(0)
    assert cuda.calls == [
        ("record", "load"),
        ("wait_event", "scatter"),
        ("record", "scatter"),
        ("wait_event", "forward"),
    ]
    with ordering.saving():
        pass
    assert ("wait_stream", "save", "scatter") in cuda.calls


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_copy_plan_that_fails_makes_the_load_a_load_error(
    is_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning a job's copies (block runs, on CUDA the pinned block-id upload) can fail; the
    worker must then report every block of that load as an error, never leave vLLM to assume
    the pages arrived (the sync path plans on the load thread, where an escaped exception
    would end the thread without a report)."""
    rig = KvRig(kv_layouts.case_named("flash-attn", layers=2, kv_heads=2, head_size=8), "cpu")
    try:
        chunks = rig.chunks([4, 5, 6, 7])
        rig.step(saves=[rig.save_job(chunks)])

        def broken_plan(self: PagedKV, chunks: object) -> None:
            raise RuntimeError("no pinned memory left")

        monkeypatch.setattr(PagedKV, "plan", broken_plan)
        loads = [dataclasses.replace(c, block_ids=(40, 41, 42, 43)) for c in chunks]
        result = rig.step(loads=[rig.load_job(loads, is_async=is_async)])
        assert result.load_errors == {40, 41, 42, 43}
        assert result.out.load_failed == {"req-load": {0}} and not result.out.loaded
    finally:
        rig.close()
