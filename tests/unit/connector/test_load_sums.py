"""A load's checksums (``load_sums.py``): the damaged chunk named, on one thread or side by
side, whole chunks or chunks split over two extents, a chunk copied twice checked once and
chunks without a checksum counted; and, taken layer by layer as a CUDA load's copies end,
the same sums, never reading a byte before the copies of its layer ended."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.connector.layout import FULL, SLIDING_WINDOW, GroupGeometry, KvGeometry
from kvtier.connector.load_sums import LayerwiseSums, Verifiers, bad_chunks
from kvtier.connector.metadata import ChunkCopy
from kvtier.core.chunks import extent_pieces
from kvtier.store.client.shm import checksum_views

CHUNK = 4096


def _chunks(segment: np.ndarray, split: bool) -> list[ChunkCopy]:
    """Four chunks; with ``split`` each in two extents."""
    out = []
    for i in range(4):
        at = i * 2 * CHUNK
        extents = ((at, 1000), (at + CHUNK + 64, CHUNK - 1000)) if split else ((at, CHUNK),)
        views = [segment[o : o + n] for o, n in extents]
        out.append(ChunkCopy(extents, checksum_views(views), 0, (1,), bytes([i]) * 16))
    return out


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_damaged_chunk_is_named_and_unsummed_ones_counted(split: bool, threads: int) -> None:
    segment = np.random.default_rng(0).integers(0, 256, 10 * CHUNK, dtype=np.uint8)
    chunks = _chunks(segment, split)
    unsummed = ChunkCopy(chunks[0].extents, 0, 0, (1,), b"u" * 16)
    todo = [*chunks, chunks[2], unsummed]  # chunk 2 copied twice (two groups): checked once
    verifiers = Verifiers()
    try:
        assert bad_chunks(todo, segment, verifiers.pool(threads)) == ([], 1)
        offset, size = chunks[2].extents[-1]
        segment[offset + size - 1] ^= 1  # the last byte of the last extent
        assert bad_chunks(todo, segment, verifiers.pool(threads)) == ([chunks[2].key], 1)
    finally:
        verifiers.shutdown()


def test_one_thread_means_no_pool_and_a_pool_is_made_once() -> None:
    verifiers = Verifiers()
    assert verifiers.pool(1) is None
    pool = verifiers.pool(4)
    assert isinstance(pool, ThreadPoolExecutor) and verifiers.pool(4) is pool
    verifiers.shutdown()
    assert verifiers.pool(1) is None


PAGE = 256
PLAIN = KvGeometry(("l0", "l1", "l2", "l3"), 16, PAGE, 64, "test")
HYBRID = KvGeometry(
    ("f0", "f1", "w0"),
    16,
    PAGE,
    64,
    "test",
    (
        GroupGeometry(FULL, ("f0", "f1"), 4, source=0),
        GroupGeometry(SLIDING_WINDOW, ("w0",), 2, 32, source=1),
    ),
)


def _geo_chunks(geo: KvGeometry, segment: np.ndarray, split: bool) -> list[ChunkCopy]:
    """Three chunks of ``geo``; with ``split`` each in two extents cut inside a page."""
    out, size = [], geo.chunk_bytes
    for i in range(3):
        at = i * 2 * size
        if split:
            cut = PAGE + PAGE // 2
            extents: tuple[tuple[int, int], ...] = ((at, cut), (at + size + 64, size - cut))
        else:
            extents = ((at, size),)
        views = [segment[o : o + n] for o, n in extents]
        out.append(ChunkCopy(extents, checksum_views(views), 0, (1, 2, 3, 4), bytes([i]) * 16))
    return out


class _Gate:
    """A layer's event whose ``synchronize`` says it was reached and waits to be let go."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.reached.set()
        assert self.release.wait(10)


@pytest.mark.parametrize("geo", [PLAIN, HYBRID], ids=["one group", "two groups"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("threads", [1, 3])
def test_layer_by_layer_sums_are_the_chunks_checksums(
    geo: KvGeometry, split: bool, threads: int
) -> None:
    segment = np.random.default_rng(3).integers(0, 256, 8 * geo.chunk_bytes, dtype=np.uint8)
    chunks = _geo_chunks(geo, segment, split)
    other = _geo_chunks(geo, segment, not split)[2:]
    verifiers = Verifiers()
    executor = verifiers.pool(threads, always=True)
    assert executor is not None
    # two jobs, one chunk copied twice (two KV cache groups): one sum each
    loads = {"a": ([*chunks, chunks[1]], segment), "b": (other, segment)}
    sums = LayerwiseSums(loads, geo, executor, threads)
    try:
        for layer in range(geo.num_layers):
            sums.layer_issued(layer, None)
        sums.finish()
        assert sums.bad("a") == [] and sums.bad("b") == []
    finally:
        sums.abandon()
        verifiers.shutdown()


@pytest.mark.parametrize("geo", [PLAIN, HYBRID], ids=["one group", "two groups"])
def test_a_byte_is_hashed_only_after_its_layers_copies_ended(geo: KvGeometry) -> None:
    """Bytes of the later layers changed while layer 1's copies are still running (its
    event not passed) are what the sums see; a changed byte of layer 0 is caught."""
    segment = np.random.default_rng(4).integers(0, 256, 8 * geo.chunk_bytes, dtype=np.uint8)
    chunks = _geo_chunks(geo, segment, split=True)
    later = segment.copy()
    for chunk in chunks:  # a byte of every layer but the first changes
        for layer in range(1, geo.num_layers):
            at = geo.layer_offset(layer) + 5
            offset, _ = next(extent_pieces(chunk.extents, at, 1))
            later[offset] ^= 0xFF
    expected = [
        dataclasses.replace(c, checksum=checksum_views([later[o : o + n] for o, n in c.extents]))
        for c in chunks
    ]
    verifiers = Verifiers()
    executor = verifiers.pool(1, always=True)
    assert executor is not None
    sums = LayerwiseSums({"a": (expected, segment)}, geo, executor, 1)
    gate = _Gate()
    try:
        sums.layer_issued(0, None)
        sums.layer_issued(1, gate)
        assert gate.reached.wait(10)  # layer 0 hashed; layer 1's copies not ended yet
        segment[:] = later  # what the later layers' copies read
        gate.release.set()
        for layer in range(2, geo.num_layers):
            sums.layer_issued(layer, None)
        sums.finish()
        assert sums.bad("a") == []
    finally:
        sums.abandon()
        verifiers.shutdown()


def test_abandoned_sums_end_their_threads_and_a_failed_event_is_raised() -> None:
    segment = np.zeros(8 * PLAIN.chunk_bytes, dtype=np.uint8)
    chunks = _geo_chunks(PLAIN, segment, split=False)
    verifiers = Verifiers()
    executor = verifiers.pool(2, always=True)
    assert executor is not None
    try:
        sums = LayerwiseSums({"a": (chunks, segment)}, PLAIN, executor, 2)
        sums.layer_issued(0, None)
        sums.abandon()  # layers 1..3 never issued: the threads end anyway
        assert all(future.done() for future in sums._futures)

        class Broken:
            def synchronize(self) -> None:
                raise RuntimeError("CUDA error: an illegal memory access")

        sums = LayerwiseSums({"a": (chunks, segment)}, PLAIN, executor, 2)
        for layer in range(PLAIN.num_layers):
            sums.layer_issued(layer, Broken() if layer == 2 else None)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            sums.finish()
        sums.abandon()
    finally:
        verifiers.shutdown()
