"""The lease region's format (``kvtier.store.client.view_leases`` has what it is for and the
protocol around it): its layout, and the extent map of the pool's committed chunks that the
store writes (``ExtentMapWriter``) and engines read (``ExtentMap``).

Layout (page-aligned, after the view in the pool segment; the view's header word 8 gives its
offset from the view's start, 0 = none): a header of ``REGION_HEADER`` little-endian u64
(magic, map slots, pin slots, pins per row, ring size, page size, unmapped chunks, the longest
TTL the store grants in ms), the map (``ENTRY`` words per slot: tag, check, serial,
size | runs << 48, checksum, then ``MAX_RUNS`` runs as first page << 32 | page count), then
the pin rows (``ROW_HEAD + pins + ring`` words: owner, ring head, cleared, pins, ring).

A chunk's identity in the map is 128 bits of its key XOR its namespace id: the view's tag
(``tag_of_id``) and a second 8-byte ``check`` (``check_of``).

Threading: one writer of the map, the store, under its event log's lock and the view's
seqlock; readers retry a read that saw the sequence move (``ViewLeaser``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.core.chunks import ChunkLocation
from kvtier.store.client.view import EMPTY, TOMBSTONE

REGION_MAGIC = 0x6B7674696572706E  # "kvtierpn"
# magic, map slots, pin slots, pins per row, ring, page size, unmapped, max lease TTL (ms)
REGION_HEADER = 8
ENTRY = 8  # words per map slot
MAX_RUNS = 3
ROW_HEAD = 3  # owner session, ring head, pins the store cleared (lifetime)
MAP_LOAD = 0.7
PAGE = 4096


@dataclass(frozen=True, slots=True)
class RegionShape:
    map_slots: int
    pin_slots: int
    pins: int
    ring: int

    @property
    def row_words(self) -> int:
        return ROW_HEAD + self.pins + self.ring

    @property
    def pins_at(self) -> int:
        """Word offset of the pin rows."""
        return REGION_HEADER + self.map_slots * ENTRY

    @property
    def nbytes(self) -> int:
        words = self.pins_at + self.pin_slots * self.row_words
        return -(-words * 8 // PAGE) * PAGE


def region_shape(max_chunks: int, pin_slots: int, pins: int, ring: int) -> RegionShape:
    """A region whose map holds ``max_chunks`` below ``MAP_LOAD``."""
    slots = 1024
    while slots * MAP_LOAD < max_chunks * 1.25:
        slots *= 2
    return RegionShape(slots, pin_slots, pins, ring)


MASK64 = (1 << 64) - 1


def tag_of_id(id_: int) -> int:
    """``tag_of`` from the key XOR namespace id as one 128-bit little-endian int."""
    tag = id_ & MASK64
    return tag + 2 if tag < 2 else tag


def check_of(ns_id: bytes, key: bytes) -> int:
    """The second half of a chunk's identity in the map (the tag is the first)."""
    return int.from_bytes(key[8:16], "little") ^ int.from_bytes(ns_id[8:16], "little")


def word_of(value: int) -> np.uint64:
    return np.uint64(value & 0xFFFFFFFFFFFFFFFF)


class ExtentMap:
    """Reader of the map: open addressing on the tag (column 0), linear probing."""

    def __init__(self, words: np.ndarray) -> None:
        header = words[:REGION_HEADER]
        self.words = words
        self.map_slots = int(header[1])
        self.page_size = int(header[5])
        self.max_ttl_s = int(header[7]) / 1000
        self.shape = RegionShape(self.map_slots, int(header[2]), int(header[3]), int(header[4]))
        self.table = words[REGION_HEADER : self.shape.pins_at].reshape(self.map_slots, ENTRY)
        rows = words[
            self.shape.pins_at : self.shape.pins_at + self.shape.pin_slots * self.shape.row_words
        ]
        self.rows = rows.reshape(self.shape.pin_slots, self.shape.row_words)
        self._mask = self.map_slots - 1

    def valid(self) -> bool:
        return int(self.words[0]) == REGION_MAGIC

    @property
    def unmapped(self) -> int:
        return int(self.words[6])

    def find(self, tag: int) -> int | None:
        table, mask = self.table, self._mask
        i = tag & mask
        for _ in range(self.map_slots):
            word = int(table[i, 0])
            if word == tag:
                return i
            if word == EMPTY:
                return None
            i = (i + 1) & mask
        return None

    def entry(self, tag: int, check: int) -> list[int] | None:
        """The slot of the chunk (``tag``, ``check``) as Python ints, or None: one numpy read
        per probe (the engine's hot path)."""
        table, mask = self.table, self._mask
        i = tag & mask
        for _ in range(self.map_slots):
            row: list[int] = table[i].tolist()
            if row[0] == tag:
                return row if row[1] == check else None
            if row[0] == EMPTY:
                return None
            i = (i + 1) & mask
        return None

    def location(self, key: bytes, row: list[int]) -> ChunkLocation:
        size, runs = row[3] & ((1 << 48) - 1), row[3] >> 48
        page, extents, left = self.page_size, [], size
        for run in row[5 : 5 + runs]:
            nbytes = min((run & 0xFFFFFFFF) * page, left)
            extents.append(((run >> 32) * page, nbytes))
            left -= nbytes
        return ChunkLocation(key, size, tuple(extents), row[4])


class ExtentMapWriter(ExtentMap):
    """The store's side. Call inside the view writer's write section (its seqlock)."""

    def __init__(
        self, words: np.ndarray, shape: RegionShape, page_size: int, max_ttl_s: float = 600.0
    ) -> None:
        words[:] = 0
        words[1], words[2], words[3] = shape.map_slots, shape.pin_slots, shape.pins
        words[4], words[5], words[7] = shape.ring, page_size, int(max_ttl_s * 1000)
        super().__init__(words)
        self._records: dict[int, np.ndarray] = {}  # tag -> its row (what a rebuild re-inserts)
        self._used = 0  # live + tombstones
        self._unmapped: set[int] = set()
        words[0] = REGION_MAGIC

    def put(
        self,
        tag: int,
        check: int,
        serial: int,
        size: int,
        checksum: int,
        runs: Sequence[tuple[int, int]],
    ) -> None:
        if len(runs) > MAX_RUNS or len(self._records) + 1 > MAP_LOAD * self.map_slots:
            self._unmapped.add(tag)
            self.words[6] = len(self._unmapped)
            return
        row = np.zeros(ENTRY, dtype=np.uint64)
        row[0], row[1], row[2] = word_of(tag), word_of(check), serial
        row[3], row[4] = size | len(runs) << 48, checksum
        for i, (start, count) in enumerate(runs):
            row[5 + i] = start << 32 | count
        self.drop(tag)
        if self._used + 1 > MAP_LOAD * self.map_slots:
            self._rebuild()
        self._records[tag] = row
        self._insert(row)

    def drop(self, tag: int) -> None:
        self._unmapped.discard(tag)
        if self._records.pop(tag, None) is not None:
            i = self.find(tag)
            if i is not None:
                self.table[i] = 0
                self.table[i, 0] = TOMBSTONE
        self.words[6] = len(self._unmapped)

    def set_checksum(self, tag: int, serial: int, checksum: int) -> None:
        row = self._records.get(tag)
        if row is None or int(row[2]) != serial:
            return
        row[4] = word_of(checksum)
        i = self.find(tag)
        if i is not None:
            self.table[i, 4] = word_of(checksum)

    def clear(self) -> None:
        self.table[:] = 0
        self._records.clear()
        self._unmapped.clear()
        self._used = 0
        self.words[6] = 0

    def _insert(self, row: np.ndarray) -> None:
        table, mask = self.table, self._mask
        i = int(row[0]) & mask
        while True:
            word = int(table[i, 0])
            if word in (EMPTY, TOMBSTONE):
                table[i] = row
                if word == EMPTY:
                    self._used += 1
                return
            i = (i + 1) & mask

    def _rebuild(self) -> None:
        self.table[:] = 0
        self._used = 0
        for row in self._records.values():
            self._insert(row)
