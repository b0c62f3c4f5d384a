"""Chunks committed without a checksum, waiting for the store to compute it.

Writers may commit without a checksum (0) so a put costs one memcpy; the store computes it
afterwards, off the writer's path (``NodeStore``'s checksum thread), pinning the chunk
meanwhile so it cannot change. A peer's read lease needs every checksum at once
(``record``, from ``kvtier.store.remote.fetch``).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvtier.core.chunks import ChunkLocation
from kvtier.store.state.entries import ChunkEntry
from kvtier.store.state.pages import PageBook


class ChecksumQueue:
    def __init__(self, pages: PageBook) -> None:
        self.pages = pages
        self._waiting: deque[ChunkEntry] = deque()
        self.on_waiting: Callable[[], None] | None = None  # told when a chunk starts waiting

    def add(self, entry: ChunkEntry) -> None:
        """``entry`` was committed without a checksum."""
        self._waiting.append(entry)
        if self.on_waiting is not None:
            self.on_waiting()

    def take(self, limit: int) -> list[tuple[ChunkEntry, ChunkLocation]]:
        """Pin up to ``limit`` committed chunks that still lack a checksum."""
        out: list[tuple[ChunkEntry, ChunkLocation]] = []
        while self._waiting and len(out) < limit:
            entry = self._waiting.popleft()
            if entry.doomed or entry.checksum:
                continue
            self.pages.pin(entry)
            out.append((entry, self.pages.location(entry)))
        return out

    def __len__(self) -> int:
        return sum(1 for e in self._waiting if not e.doomed and not e.checksum)

    def finish(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for ``take``'s chunks and unpin them."""
        for entry, checksum in done:
            entry.checksum = checksum
            self.pages.unpin(entry)

    @staticmethod
    def record(done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for pinned chunks (e.g. of a read lease)."""
        for entry, checksum in done:
            if not entry.checksum:
                entry.checksum = checksum
