"""A load's checksums (``verify_loads``): each byte read for its sum only after the copy that
read it for the engine has ended, chunks side by side where there are threads for them.

Why after: a byte that changed under the copy (a lapsed lease whose pages went to another
writer) then changes the sum too. Why side by side: on CUDA the copy engine moves ~52 GB/s and
one thread's XXH3 ~6.5 GB/s, so one thread made an 8k-token hit 7-9x its copy on an H200; on 8
threads following the copies 1.3-1.5x (docs/benchmarks.md, CUDA copy path). ``bad_chunks``
hashes a load once its copies have all ended (CPU engines, async loads, small layers);
``LayerwiseSums`` follows a CUDA sync load's copies layer by layer (``sync_loads.py`` decides).

Threading: XXH3 releases the GIL, so chunks hash side by side on the ``kvtier-verify`` pool;
a chunk is hashed by one task.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.core.chunks import extent_pieces
from kvtier.store.client.shm import checksum_views


class Verifiers:
    """The threads a worker's load checksums run on (``kvtier-verify``), made when a load
    first needs more than one."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def pool(self, threads: int, always: bool = False) -> ThreadPoolExecutor | None:
        """``threads`` > 1 (or ``always``): the pool (made with that many the first time);
        else None."""
        if threads <= 1 and not always:
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
    taken: list[bytes] | None = None,
) -> tuple[list[bytes], int]:
    """(keys of the loaded ``chunks`` whose pool bytes fail their checksum, how many had no
    checksum to check). A chunk split over several copies is checked once; chunks hash side
    by side on ``verifiers`` when given. ``taken``: the bad keys ``LayerwiseSums`` found."""
    todo: list[ChunkCopy] = []
    seen: set[bytes] = set()
    unsummed = 0
    for chunk in chunks:
        if chunk.key in seen:
            continue
        seen.add(chunk.key)
        if not chunk.checksum:
            unsummed += 1
            continue
        todo.append(chunk)
    if taken is not None:
        return taken, unsummed
    views = [[segment[o : o + n] for o, n in chunk.extents] for chunk in todo]
    if verifiers is not None and len(todo) > 1:  # XXH3 releases the GIL
        got = list(verifiers.map(checksum_views, views))
    else:
        got = [checksum_views(chunk_views) for chunk_views in views]
    bad = [chunk.key for chunk, sum_ in zip(todo, got, strict=True) if sum_ != chunk.checksum]
    return bad, unsummed


@dataclass
class _Running:
    """One chunk's checksum being taken: its bytes ``[0, done)`` are in ``hasher``."""

    req_id: str
    chunk: ChunkCopy
    segment: np.ndarray
    total: int
    hasher: Any = field(default_factory=xxhash.xxh3_64)
    done: int = 0


class LayerwiseSums:
    """A sync load's checksums taken while its later layers still copy (CUDA).

    A chunk's bytes are its layers' pages, layer after layer (``KvGeometry.layer_offset``),
    and the load thread issues the copies layer after layer on one stream. After issuing
    layer ``L`` it records an event there (``layer_issued``); each hashing thread follows
    the layers, waits for that event (the copies that read layer ``L``'s pool bytes have
    ended) and hashes its chunks up to where layer ``L + 1`` starts. A chunk is hashed by one
    thread, in byte order, each byte only after the copy that read it. ``finish`` waits for
    the threads; ``bad`` then names a job's chunks that do not match.

    One task per thread for the whole load, not one per layer: 1,024 per-layer tasks (32
    chunks x 32 layers) cost more than they hid (docs/benchmarks.md, CUDA copy path).
    ``abandon`` must end every such load (``finally``), or its threads would wait forever
    for layers that are never issued.
    """

    def __init__(
        self,
        loads: Mapping[str, tuple[Iterable[ChunkCopy], np.ndarray]],
        geometry: KvGeometry,
        verifiers: ThreadPoolExecutor,
        threads: int,
    ) -> None:
        self._layers = geometry.num_layers
        self._ends: list[int | None] = [
            geometry.layer_offset(layer + 1) for layer in range(self._layers - 1)
        ] + [None]
        self._issued = [threading.Event() for _ in range(self._layers)]
        self._marks: list[Any] = [None] * self._layers
        self._stop = False
        running: list[_Running] = []
        for req_id, (chunks, segment) in loads.items():
            seen: set[bytes] = set()
            for chunk in chunks:
                if chunk.key not in seen and chunk.checksum:  # unsummed: counted at the end
                    seen.add(chunk.key)
                    total = sum(n for _, n in chunk.extents)
                    running.append(_Running(req_id, chunk, segment, total))
        self._running = running
        parts: list[list[_Running]] = [[] for _ in range(max(1, min(threads, len(running))))]
        for i, entry in enumerate(sorted(running, key=lambda e: -e.total)):
            parts[i % len(parts)].append(entry)
        self._futures = [verifiers.submit(self._follow, part) for part in parts if part]

    def _follow(self, part: list[_Running]) -> None:
        for layer in range(self._layers):
            self._issued[layer].wait()
            if self._stop:
                return
            mark = self._marks[layer]
            if mark is not None:
                mark.synchronize()  # layer ``layer``'s pool reads have ended
            end = self._ends[layer]
            for entry in part:
                stop = entry.total if end is None else min(end, entry.total)
                if stop > entry.done:
                    for offset, n in extent_pieces(
                        entry.chunk.extents, entry.done, stop - entry.done
                    ):
                        entry.hasher.update(entry.segment[offset : offset + n].data)
                    entry.done = stop

    def layer_issued(self, layer: int, mark: Any) -> None:
        """Layer ``layer``'s copies are issued; ``mark``: an event after them (None: done)."""
        self._marks[layer] = mark
        self._issued[layer].set()

    def finish(self) -> None:
        """Wait for the hashing threads (every layer issued); raises what one raised."""
        for future in self._futures:
            future.result()

    def abandon(self) -> None:
        """End the hashing threads where they are (after ``finish``: nothing left to do)."""
        self._stop = True
        for issued in self._issued:
            issued.set()
        for future in self._futures:
            future.exception()  # waits; what it raised was reported by ``finish``, if asked

    def bad(self, req_id: str) -> list[bytes]:
        """Keys of job ``req_id``'s chunks whose bytes do not match their checksum."""
        return [
            entry.chunk.key
            for entry in self._running
            if entry.req_id == req_id and (entry.hasher.intdigest() or 1) != entry.chunk.checksum
        ]
