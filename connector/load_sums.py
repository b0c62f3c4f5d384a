"""A load's checksums (``verify_loads``), taken after its copies have ended and, where there
is more than one thread for them, chunks side by side.

A byte must be read for the checksum only after the copy that read it for the engine has
ended: a byte that changed under the copy (a lapsed lease whose pages went to another writer)
then changes the sum too. On CUDA the copy engine moves ~52 GB/s and one thread's XXH3 ~6.5
GB/s, so one thread made an 8k-token hit 7-9x its copy on an H200; 8 threads bring it to
~2x (docs/benchmarks.md, CUDA copy path). Hashing each layer as its copy ended, while later
layers copy, was measured too and not kept: per-layer tasks cost more than they hid there
for small pages (MLA 45 ms against 19.5) and 256-token chunks.

Threading: XXH3 releases the GIL, so chunks hash side by side on the ``kvtier-verify`` pool;
a chunk is hashed by one task.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.connector.metadata import ChunkCopy
from kvtier.store.client.shm import checksum_views


class Verifiers:
    """The threads a worker's load checksums run on (``kvtier-verify``), made when a load
    first needs more than one."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def pool(self, threads: int) -> ThreadPoolExecutor | None:
        """``threads`` > 1: the pool (made with that many the first time); else None."""
        if threads <= 1:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-verify")
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def bad_chunks(
    chunks: Iterable[ChunkCopy],
    segment: np.ndarray,
    verifiers: ThreadPoolExecutor | None,
) -> tuple[list[bytes], int]:
    """(keys of the loaded ``chunks`` whose pool bytes fail their checksum, how many had no
    checksum to check). A chunk split over several copies is checked once; chunks hash side
    by side on ``verifiers`` when given."""
    todo: list[tuple[bytes, int, list[np.ndarray]]] = []
    seen: set[bytes] = set()
    unsummed = 0
    for chunk in chunks:
        if chunk.key in seen:
            continue
        seen.add(chunk.key)
        if not chunk.checksum:
            unsummed += 1
            continue
        todo.append((chunk.key, chunk.checksum, [segment[o : o + n] for o, n in chunk.extents]))
    if verifiers is not None and len(todo) > 1:  # XXH3 releases the GIL
        got = list(verifiers.map(checksum_views, [views for _, _, views in todo]))
    else:
        got = [checksum_views(views) for _, _, views in todo]
    return [key for (key, want, _), sum_ in zip(todo, got, strict=True) if sum_ != want], unsummed
