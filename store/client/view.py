"""The store's read-only view of its committed chunks, mapped by every engine on the node, so a
lookup that misses answers without a round trip to the store.

Layout (in the pool segment, after the pages; ``StoreInfo.view_offset`` / ``view_bytes``): a
header of eight little-endian u64 — magic, sequence (a seqlock: odd while the store writes),
the store epoch, the slot count (a power of two), the store's ``max_batch_keys`` (a larger
lookup is the store's to refuse), when the store last said it is alive (``CLOCK_MONOTONIC``
ns, which every process on the node shares), how old that may be, and which of the store's
tiers the view covers (``COVERS_POOL``, ``COVERS_DISK``) — then the slots, one u64 tag each,
an open-addressing set with linear probing: 0 = empty, 1 = a removed tag.

What it holds: every chunk the store could serve from a tier it covers — the committed chunks
of its pool and, with the disk tier on, the chunk files of its disk (a chunk in both is one
tag; it leaves the view when it has left both). So an engine whose only staging tier is the
node's disk also answers its misses without a round trip.

A chunk's tag is its key's first 8 bytes XOR its namespace id's first 8 bytes (both are
hashes; 0 and 1 are moved to 2 and 3). An engine can compute the tag of a chunk only from its
key, i.e. from its own namespace id, which carries its tenant's salt: to anyone else the view
is a set of random numbers (how many chunks the node holds is all it tells; docs/security.md).

A store that died without closing (SIGKILL) cannot retire its view, and one frozen cannot
follow its chunks: its alive stamp stops moving, and past the max age readers ask the store
(which answers UNAVAILABLE, or STALE_EPOCH from its next incarnation: the client re-attaches
and maps the new view).

What a reader may conclude: "absent" is a miss, always safe to act on (at worst a hit the
store had is recomputed: a torn or stale read can only lose a hit). "Present" means nothing
until the store leases it: every hit is still asked of the store, which is the authority.

Threading: one writer, the store, under its state lock (``EventLog`` hands it every change
in order); readers are lock-free (the seqlock: a read that saw the sequence odd or moved is
retried, and after ``READ_TRIES`` given up as "unknown": ask the store).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.client.shm import SHM_DIR

if TYPE_CHECKING:
    from kvtier.store.client.lease_region import ExtentMapWriter

# what the store tells the view of a committed pool chunk: (check, serial, size, checksum,
# page runs), for the lease region's extent map
Record = tuple[int, int, int, int, Any]

MAGIC = 0x6B76746965727633  # "kvtierv3" (v2 had no lease region: its readers ask the store)
# magic, sequence, epoch, slots, max batch keys, alive at, max age, covers, then the offset
# of the lease region from the view's start (0: none; kvtier.store.client.lease_region)
HEADER_WORDS = 16
COVERS_POOL, COVERS_DISK = 1, 2  # the tiers a view covers (header word 7), one bit each
EMPTY, TOMBSTONE = 0, 1
READ_TRIES = 8
MAX_LOAD = 0.7  # slots in use (live + tombstones) before the writer rebuilds the table


def open_view(segment_name: str, offset: int, size: int) -> tuple[ChunkView, mmap.mmap]:
    """Map a store's view read-only (only its pages, not the pool's): the reader and the
    mapping, which the caller keeps as long as it reads. OSError if the segment is gone."""
    fd = os.open(SHM_DIR / segment_name, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
    finally:
        os.close(fd)
    words = np.frombuffer(mapped, dtype=np.uint64)
    slots = int(words[3]) if len(words) > HEADER_WORDS else 0
    return ChunkView(words[: HEADER_WORDS + slots] if slots else words), mapped


def view_bytes_for(max_chunks: int) -> int:
    """Bytes of a view that holds ``max_chunks`` chunks below ``MAX_LOAD``."""
    slots = 1024
    while slots * MAX_LOAD < max_chunks * 1.25:
        slots *= 2
    return (HEADER_WORDS + slots) * 8


def tag_of(ns_id: bytes, key: bytes) -> int:
    tag = int.from_bytes(key[:8], "little") ^ int.from_bytes(ns_id[:8], "little")
    return tag + 2 if tag < 2 else tag


class ChunkView:
    """A reader over the view's words (a uint64 array over the mapped segment)."""

    def __init__(self, words: np.ndarray) -> None:
        self._words = words
        self._slots = words[HEADER_WORDS:]
        self._mask = len(self._slots) - 1

    @property
    def epoch(self) -> int:
        return int(self._words[2])

    @property
    def words(self) -> np.ndarray:
        return self._words

    @property
    def region_offset(self) -> int:
        """Where the lease region starts, in bytes from the view's start (0: none)."""
        return int(self._words[8])

    def answers(self) -> bool:
        """Not retired (its store closed) nor overfull; read inside a seqlock read."""
        return int(self._words[0]) == MAGIC and bool(int(self._words[7]))

    def run_of(self, tags: Sequence[int]) -> int:
        """How many of ``tags`` the set holds in a row from the first (inside a seqlock
        read: the caller checks the sequence)."""
        n = 0
        for tag in tags:
            if not self._probe(tag):
                break
            n += 1
        return n

    def valid(self) -> bool:
        return int(self._words[0]) == MAGIC and len(self._slots) == int(self._words[3])

    @property
    def covers_disk(self) -> bool:
        """The view holds the store's disk chunks too (the word is set before readers map
        it, and is 0 only while the view is overfull: then it answers nothing)."""
        return bool(int(self._words[7]) & COVERS_DISK)

    def _slot_of(self, tag: int) -> int | None:
        """The slot holding ``tag`` (linear probing from its home slot), or None."""
        slots, mask = self._slots, self._mask
        i = tag & mask
        for _ in range(len(slots)):
            word = int(slots[i])
            if word == tag:
                return i
            if word == EMPTY:
                return None
            i = (i + 1) & mask
        return None

    def _probe(self, tag: int) -> bool:
        return self._slot_of(tag) is not None

    def misses(self, ns_id: bytes, keys: Sequence[bytes]) -> bool:
        """True when a lookup of ``keys`` is a miss without asking the store: its first chunk
        is not committed. False: ask the store (it may hit, the read was not clean, or the
        batch is one the store refuses)."""
        words = self._words
        if not keys or len(keys) > int(words[4]):
            return False
        if time.monotonic_ns() - int(words[5]) > int(words[6]):
            return False  # the store has not said it is alive lately: ask it
        return self.prefix_len(ns_id, keys[:1]) == 0

    def prefix_len(self, ns_id: bytes, keys: Sequence[bytes]) -> int | None:
        """How many of ``keys`` the view holds in a row from the first, or None when no
        consistent read was had (ask the store)."""
        words = self._words
        tags = [tag_of(ns_id, k) for k in keys]
        for _ in range(READ_TRIES):
            seq = int(words[1])
            if seq & 1:
                continue
            if not self.answers():
                return None  # retired (its store closed) or overfull (it holds too many)
            n = self.run_of(tags)
            if int(words[1]) == seq:
                return n
        return None


class ChunkViewWriter(ChunkView):
    """The store's side: keeps the set equal to the chunks of the tiers it covers (``covers``,
    a mask of ``COVERS_*``). Not thread-safe: the caller serializes (the store's event log
    does)."""

    def __init__(
        self,
        words: np.ndarray,
        epoch: int,
        max_batch_keys: int,
        max_age_s: float,
        covers: int = COVERS_POOL,
        region_offset: int = 0,
    ) -> None:
        super().__init__(words)
        slots = len(words) - HEADER_WORDS
        if slots & (slots - 1):
            raise ValueError("a view's slot count is a power of two")
        self.covers = covers
        self._live: dict[int, int] = {}  # tag -> the COVERS_* bits of the tiers holding it
        self._used = 0  # live + tombstones
        # More chunks than slots (small chunks on a large disk): the table would have to leave
        # some out, which readers would take for misses (lost hits). It answers nothing
        # instead (coverage word 0: ask the store) until it fits again with room to spare.
        self.overfull = False
        # the lease region's map of pool chunks (kvtier.store.client.lease_region), kept in
        # step under the same seqlock
        self.extents: ExtentMapWriter | None = None
        words[:] = 0
        words[2], words[3], words[4] = epoch, slots, max_batch_keys
        words[6], words[7], words[8] = int(max_age_s * 1e9), covers, region_offset
        self.alive()
        words[0] = MAGIC

    def alive(self) -> None:
        """Say the store is alive (every ``max_age_s / 3`` or more often): one aligned word,
        no seqlock needed."""
        self._words[5] = time.monotonic_ns()

    def _begin(self) -> None:
        self._words[1] += 1  # odd: readers retry

    def _end(self) -> None:
        self._words[1] += 1

    def apply(
        self,
        added: list[int],
        removed: list[int],
        tier: int = COVERS_POOL,
        records: Sequence[Record | None] | None = None,
    ) -> None:
        """``tier`` (one ``COVERS_*`` bit) gained the chunks tagged ``added`` and lost
        ``removed``; a tag leaves the set when no covered tier holds it. ``records``: the
        pool's added chunks for the extent map, one per tag (None: leave it out)."""
        if not added and not removed:
            return
        live = self._live
        extents = self.extents if tier == COVERS_POOL else None
        self._begin()
        try:
            if extents is not None:
                for tag in removed:
                    extents.drop(tag)
                for tag, record in zip(added, records or (), strict=False):
                    if record is not None:
                        extents.put(tag, *record)
            for tag in removed:
                held = live.get(tag, 0)
                if held & tier:
                    if held == tier:
                        del live[tag]
                        if not self.overfull:
                            self._remove(tag)
                    else:
                        live[tag] = held & ~tier
            for tag in added:
                held = live.get(tag, 0)
                if not held and not self.overfull:
                    if (self._used + 1) > MAX_LOAD * len(self._slots):
                        self._rebuild()
                    if not self.overfull:
                        self._insert(tag)
                live[tag] = held | tier
            if self.overfull and len(live) < MAX_LOAD / 2 * len(self._slots):
                self._rebuild()
        finally:
            self._end()

    def retire(self) -> None:
        """The store is closing: readers stop trusting the view (they ask the store, which
        answers UNAVAILABLE, or STALE_EPOCH once a new incarnation serves)."""
        self._begin()
        self._words[0] = 0
        self._end()

    def set_checksums(self, items: Sequence[tuple[int, int, int]]) -> None:
        """(tag, serial, checksum) of pool chunks whose checksum the store computed after
        they were committed."""
        if self.extents is None or not items:
            return
        self._begin()
        try:
            for tag, serial, checksum in items:
                self.extents.set_checksum(tag, serial, checksum)
        finally:
            self._end()

    def clear(self) -> None:
        self._begin()
        if self.extents is not None:
            self.extents.clear()
        self._live.clear()
        self._slots[:] = EMPTY
        self._used = 0
        self.overfull = False
        self._words[7] = self.covers
        self._end()

    def _insert(self, tag: int) -> None:
        slots, mask = self._slots, self._mask
        i = tag & mask
        while True:
            word = int(slots[i])
            if word in (EMPTY, TOMBSTONE):
                slots[i] = tag
                if word == EMPTY:
                    self._used += 1
                return
            i = (i + 1) & mask

    def _remove(self, tag: int) -> None:
        i = self._slot_of(tag)
        if i is not None:
            self._slots[i] = TOMBSTONE

    def _rebuild(self) -> None:
        """Drop the tombstones, or say the view is overfull (inside the caller's write
        section)."""
        self._slots[:] = EMPTY
        self._used = 0
        self.overfull = len(self._live) + 1 > MAX_LOAD * len(self._slots)
        self._words[7] = 0 if self.overfull else self.covers
        if not self.overfull:
            for tag in self._live:
                self._insert(tag)


def follow_events(
    writer: ChunkViewWriter, records: Callable[[bytes, bytes], Record | None] | None = None
) -> Callable[[Sequence[StoreEvent]], None]:
    """An ``EventLog`` observer that keeps ``writer`` equal to the chunks of the tiers it
    covers (the pool's events say tier "cpu", the disk tier's "disk"). ``records(namespace
    id, key)``: a pool chunk just stored, for the extent map (called under the store's
    lock, which the log's observer runs in)."""
    bits = {"cpu": COVERS_POOL, "disk": COVERS_DISK}

    def observe(events: Sequence[StoreEvent]) -> None:
        for event in events:
            if event.kind is EventKind.CLEARED:  # the pool's and the disk's
                writer.clear()
                continue
            tier = bits.get(event.tier, 0) & writer.covers
            if not tier:
                continue
            tags = [tag_of(event.namespace, k) for k in event.keys]
            if event.kind is EventKind.STORED:
                recs = None
                if records is not None and tier == COVERS_POOL:
                    recs = [records(event.namespace, k) for k in event.keys]
                writer.apply(tags, [], tier, recs)
            else:
                writer.apply([], tags, tier)

    return observe


def add_held(writer: ChunkViewWriter, held: dict[bytes, list[bytes]], tier: int) -> None:
    """Seed ``writer`` with what ``tier`` holds (namespace id -> keys): the disk's chunks a
    restarted store found before any event told of them. Call under the event log's lock."""
    tags = [tag_of(ns_id, key) for ns_id, keys in held.items() for key in keys]
    writer.apply(tags, [], tier)
