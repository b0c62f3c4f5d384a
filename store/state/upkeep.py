"""What the store's own workers do to chunks outside any client's request.

- **Checksums**: a writer may commit without one (a put costs one memcpy); the node's checksum
  thread takes those chunks pinned, computes, and finishes them (``take_unsummed``,
  ``finish_checksums``). A peer reading a lease needs every checksum at once
  (``read_lease_entries``, ``record_checksums``; ``kvtier.store.remote.fetch``).
- **Demotion**: the disk tier and the peer demoter pick what eviction would take next
  (``coldest``, ``pin_coldest``) and copy it out pinned (``unpin`` ends that); with a disk
  copy, eviction prefers a clean chunk (``prefer_evicting``).

``PoolUpkeep`` holds no state of its own: it works on ``StoreCore``'s components under
``StoreCore``'s lock, so it is ``core.upkeep`` and nothing else builds one.

Threading: every public method takes the store's lock; call from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import cast

from kvtier.core.chunks import ChunkLocation
from kvtier.store.state.checksums import ChecksumQueue
from kvtier.store.state.entries import ChunkEntry
from kvtier.store.state.leases import LeaseKind, LeaseTable
from kvtier.store.state.pages import PageBook


class PoolUpkeep:
    def __init__(
        self,
        lock: threading.RLock,
        pages: PageBook,
        checksums: ChecksumQueue,
        leases: LeaseTable,
    ) -> None:
        self._lock = lock
        self.pages = pages
        self.checksums = checksums
        self.leases = leases
        # told of chunks whose checksum was computed after their commit (the view's map follows)
        self.on_checksums: Callable[[list[ChunkEntry]], None] | None = None

    # -- checksums (``kvtier.store.state.checksums``) -----------------------------------------

    def take_unsummed(self, limit: int = 64) -> list[tuple[ChunkEntry, ChunkLocation]]:
        """Pin up to ``limit`` committed chunks that still lack a checksum."""
        with self._lock:
            return self.checksums.take(limit)

    def unsummed_count(self) -> int:
        with self._lock:
            return len(self.checksums)

    def finish_checksums(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for ``take_unsummed``'s chunks and unpin them."""
        with self._lock:
            self.checksums.finish(done)
            if self.on_checksums is not None:
                self.on_checksums([entry for entry, _ in done])

    def read_lease_entries(self, lease_id: int) -> list[ChunkEntry]:
        """The chunks pinned by a read lease, in lookup order (to checksum them in place)."""
        with self._lock:
            return list(self.leases.require(lease_id, LeaseKind.READ).entries)

    def record_checksums(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for pinned chunks (e.g. of a read lease)."""
        with self._lock:
            self.checksums.record(done)
            if self.on_checksums is not None:
                self.on_checksums([entry for entry, _ in done])

    def location_of(self, entry: ChunkEntry) -> ChunkLocation:
        with self._lock:
            return self.pages.location(entry)

    # -- demotion ----------------------------------------------------------------------------

    def coldest(self, max_bytes: int) -> list[tuple[bytes, bytes, int]]:
        """Up to ``max_bytes`` of unpinned committed chunks, coldest first, as (namespace id,
        key, size): what eviction would take next. Nothing is changed."""
        out: list[tuple[bytes, bytes, int]] = []
        with self._lock:
            total = 0
            for key in self.pages.policy.coldest(self.pages.unpinned):
                entry = self.pages.table[cast(bytes, key)]
                if total + entry.pages * self.pages.page_size > max_bytes:
                    break
                total += entry.pages * self.pages.page_size
                out.append((entry.namespace, entry.key, entry.size))
        return out

    def pin_coldest(
        self, window_bytes: int, max_bytes: int, skip: Callable[[bytes, bytes], bool]
    ) -> list[tuple[ChunkEntry, ChunkLocation]]:
        """Pin up to ``max_bytes`` of chunks (one at least) among the coldest
        ``window_bytes`` of unpinned committed ones (what eviction takes next) for which
        ``skip(namespace id, key)`` is false, without counting it as a use: the disk tier
        copies them, ``unpin`` ends it. ``skip`` runs under the store's lock."""
        out: list[tuple[ChunkEntry, ChunkLocation]] = []
        with self._lock:
            seen = taken = 0
            for key in self.pages.policy.coldest(self.pages.unpinned):
                entry = self.pages.table[cast(bytes, key)]
                seen += entry.size
                if seen > window_bytes or (out and taken + entry.size > max_bytes):
                    break
                if skip(entry.namespace, entry.key):
                    continue
                taken += entry.size
                out.append((entry, self.pages.location(entry)))
            for entry, _ in out:
                self.pages.pin(entry)
        return out

    def prefer_evicting(self, on_disk: Callable[[bytes, bytes], bool]) -> None:
        """Eviction takes a chunk ``on_disk(namespace id, key)`` says has a copy before a
        colder one without (``PageBook._clean_victim``); called under the store's lock."""
        with self._lock:
            self.pages.on_disk = lambda entry: on_disk(entry.namespace, entry.key)

    def unpin(self, entries: Sequence[ChunkEntry]) -> None:
        """End ``pin_coldest``'s and ``pin_committed``'s pins (a chunk deleted meanwhile is
        freed now)."""
        with self._lock:
            for entry in entries:
                self.pages.unpin(entry)
