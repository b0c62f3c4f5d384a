"""A load's checksums (``load_sums.py``): the damaged chunk named, on one thread or side by
side, whole chunks or chunks split over two extents, a chunk copied twice checked once and
chunks without a checksum counted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.connector.load_sums import Verifiers, bad_chunks
from kvtier.connector.metadata import ChunkCopy
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
