"""Leased hits without a round trip: where the pool's committed chunks are, and a pin table
the engines write their read leases into, beside the store's view (``kvtier.store.client.view``).

A miss already costs no call (the view's tag set says the first chunk is absent). A hit needs
a lease: nothing is read from the pool unless the store has promised not to reuse its pages
meanwhile. Over a socket that promise costs two process wake-ups (~75 µs on the 2-core VM,
~220 µs in Python: docs/benchmarks.md, "The control path"). Here the engine takes it itself:

- the **extent map** (written by the store, read by engines) holds, per committed pool chunk,
  its identity (the view's tag plus a second 8-byte ``check``, so 128 bits of the key),
  a ``serial`` unique in this store incarnation, its size, checksum and up to ``MAX_RUNS``
  page runs. A chunk that does not fit (more runs, or a full map) is left out and counted
  (``unmapped``): readers then ask the store;
- the **pin table**: one row per session (``pin_slots`` rows), whose first word the store sets
  to the session id when it opens and clears when it ends; then the head of its hit ring and
  how many of its pins the store cleared; then ``pins`` words the engine writes the serials
  it holds into (0 = free), and the ring of the serials it hit, which the store drains to
  count the hits and keep them warm in its eviction order (a hit that never reached the
  store would otherwise look cold).

The promise is a reader-writer lock on the segment file (``flock``, per open file, released
by the kernel when the process dies): an engine takes it shared to read the map and write its
pins; the store takes it exclusive around anything that could free a committed chunk's pages
(allocation's eviction, delete, clear), reads every pin then, and holds a pinned chunk's pages
(unlinked from its table, out of the view) until its pin is gone. So an engine either pins a
chunk before the store looks (the store keeps it) or reads the map after the store removed it
(the engine does not find it). The store never waits long for an engine: it tries for
``lock_wait_s``; without the lock it evicts nothing and holds what it must unlink
(``kvtier.store.state.view_pins``).

A pin lasts until the engine releases it (a local write), its session ends (the store clears
the row) or it reaches ``store.max_lease_lifetime_s`` (the store clears its word): the lease
is then EXPIRED, as a store lease ending so is, and ``release`` / ``renew`` say so. The TTL
a lookup reports is what the store would grant (``store.max_lease_ttl_s`` caps it), so the
connector's rule that a load must start well inside it holds alike. A session gets a row as
an engine of this node opens it (``OpenSession`` saying it leases here), else on its first
leased lookup or allocation through the store's engine surface (a peer's lease never asks
for one); its lookups after that are answered here. A row
is reused by a new session only after the other free rows, so a late write of an old
session's client lands on a row nobody holds.

The region's layout and its extent map (reader and the store's writer) are
``kvtier.store.client.lease_region``; this module is the engine's side of the protocol.

Threading: ``ViewLeaser`` serializes its own threads (one flock per open file is shared by
them); a read of the map retries while the view's seqlock says the store is writing.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvtier.core.chunks import ChunkLocation, LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.types import LeaseStatus, LookupResult
from kvtier.store.client.lease_region import PAGE, ROW_HEAD, ExtentMap, tag_of_id, word_of
from kvtier.store.client.shm import SHM_DIR
from kvtier.store.client.view import READ_TRIES, ChunkView

LOCATIONS_CACHED = 1 << 16  # per leaser: the locations of chunks it hit, by serial
VIEW_LEASE = 1 << 63  # lease ids the engine made itself (the store draws its own below 2**63)
_LEASE_IDS = itertools.count(1)  # per process: a lease outlives the leaser that made it


def open_leaser(
    segment_name: str, view_offset: int, view_bytes: int, view: ChunkView
) -> ViewLeaser | None:
    """Map the lease region of the store whose ``view`` this is, read-write (the client
    writes its pins), with the segment file open for the lock. None: it has none."""
    at = view.region_offset
    if not at or at >= view_bytes or (view_offset + at) % PAGE:
        return None
    fd = os.open(SHM_DIR / segment_name, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, view_bytes - at, flags=mmap.MAP_SHARED, offset=view_offset + at)
    except BaseException:
        os.close(fd)
        raise
    leaser = ViewLeaser(view, np.frombuffer(mapped, dtype=np.uint64), fd, view.epoch, mapped)
    if not leaser.valid():
        leaser.close()
        return None
    return leaser


class ViewLeaser:
    """The engine's side: lease a committed prefix by pinning it in its session's row.

    ``lookup`` answers None whenever it cannot answer as the store would (no row for the
    session, a read that never came out clean, a chunk the map left out, no free pin words):
    the caller then asks the store."""

    def __init__(
        self,
        view: ChunkView,
        region: np.ndarray,
        lock_fd: int,
        epoch: int,
        mapped: mmap.mmap | None = None,
    ) -> None:
        """``lock_fd``: the segment file, open (owned: ``close`` closes it); ``mapped``: the
        region's mapping, unmapped by ``close``."""
        self._view = view
        self._map: ExtentMap | None = ExtentMap(region)
        self._fd = lock_fd
        self._mapped = mapped
        self.epoch = epoch
        self._lock = threading.Lock()
        self._row_of: dict[int, int] = {}  # session -> its row
        self._free: dict[int, list[int]] = {}  # row -> pin words free (its session's)
        # lease id -> (session, row, pin words, the serials they hold, the row's cleared count)
        self._leases: dict[int, tuple[int, int, list[int], list[int], int]] = {}
        self._locations: dict[int, ChunkLocation] = {}  # serial -> a hit's (checksummed)
        self.hits = 0  # leased lookups answered here

    def valid(self) -> bool:
        return self._map is not None and self._map.valid()

    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], session: int, ttl_s: float
    ) -> LookupResult | None:
        if not session or not keys:
            return None
        view = self._view
        ns = int.from_bytes(ns_id[:16], "little")
        ids = [int.from_bytes(k[:16], "little") ^ ns for k in keys]  # tag | check << 64
        with self._lock:
            emap = self._map
            if emap is None:
                return None
            row = self._row(emap, session)
            if row is None:
                return None
            if not _lock_shared(self._fd):
                return None  # the store holds it (or is stopped holding it): ask it
            try:
                entries = self._read(view, emap, ids)
                if entries is None or int(emap.rows[row, 0]) != session:
                    return None
                free = self._free[row]
                if not entries or len(entries) > len(free):
                    return None
                serials = [entry[2] for entry in entries]
                words = [free.pop() for _ in entries]
                pins = emap.rows[row]
                ring, head = emap.shape.ring, int(pins[1])
                ring_at = ROW_HEAD + emap.shape.pins
                for word, serial in zip(words, serials, strict=True):
                    pins[ROW_HEAD + word] = serial
                    pins[ring_at + head % ring] = serial  # the hit, for the eviction order
                    head += 1
                pins[1] = head
                cleared = int(pins[2])
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            lease_id = VIEW_LEASE | next(_LEASE_IDS)
            self._leases[lease_id] = (session, row, words, serials, cleared)
            ttl_s = min(ttl_s, emap.max_ttl_s)
            self.hits += 1
        hits = [self._location(emap, key, entry) for key, entry in zip(keys, entries, strict=False)]
        stop = LookupStatus.HIT if len(hits) == len(keys) else LookupStatus.MISS
        return LookupResult(hits, stop, lease_id, self.epoch, ttl_s)

    def _location(self, emap: ExtentMap, key: bytes, entry: list[int]) -> ChunkLocation:
        """A hit's location; the same chunk (serial) hit again reuses it once checksummed."""
        cached = self._locations.get(entry[2])
        if cached is not None:
            return cached
        location = emap.location(key, entry)
        if location.checksum:
            if len(self._locations) >= LOCATIONS_CACHED:
                self._locations.clear()
            self._locations[entry[2]] = location
        return location

    def _read(self, view: ChunkView, emap: ExtentMap, ids: list[int]) -> list[list[int]] | None:
        """The map's entries of the committed prefix from one clean read of the view; None if
        none was had, or the map cannot say (it left out a chunk the view's set holds)."""
        seq_word = view.words
        for _ in range(READ_TRIES):
            seq = int(seq_word[1])
            if seq & 1:
                continue
            if not view.answers():
                return None  # retired (its store closed) or overfull
            entries: list[list[int]] = []
            for id_ in ids:
                entry = emap.entry(tag_of_id(id_), id_ >> 64)
                if entry is None:
                    break
                entries.append(entry)
            short = len(entries) < len(ids) and (emap.unmapped or not view.covers_disk)
            # the set holds the next chunk, the map does not: in the pool but left out of the
            # map (on the node's disk only is a pool miss, as the store would answer)
            unsure = short and view.run_of([tag_of_id(ids[len(entries)])]) == 1
            if int(seq_word[1]) == seq:
                return None if unsure else entries
        return None

    def _row(self, emap: ExtentMap, session: int) -> int | None:
        row = self._row_of.get(session)
        if row is not None:
            return row
        owners = emap.rows[:, 0]
        found = np.flatnonzero(owners == word_of(session))
        if not len(found):
            return None
        row = int(found[0])
        self._row_of = {session: row}  # one session per client at a time
        self._free[row] = list(range(emap.shape.pins))
        return row

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End leases made here (a local write). EXPIRED: the store ended it first (its session
        ended, or it outlived ``store.max_lease_lifetime_s``): a copy under it may be torn."""
        out = []
        with self._lock:
            emap = self._map
            # The lock is a full memory barrier: the copy's reads of the pool complete before
            # the store can see a pin cleared (x86 keeps that order anyway, ARM need not).
            locked = emap is not None and _lock_shared(self._fd)
            try:
                out = self._release(emap, lease_ids)
            finally:
                if locked:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        return out

    def _release(self, emap: ExtentMap | None, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """Under ``self._lock``: each lease's status, its words cleared."""
        out = []
        for lease_id in lease_ids:
            held = self._leases.pop(lease_id, None)
            if held is None or emap is None:
                # closed: the store restarted (or this client re-attached), so whatever
                # was copied under it is suspect
                out.append(LeaseStatus.UNKNOWN if emap is not None else LeaseStatus.EXPIRED)
                continue
            session, row, words, serials, cleared = held
            if not _intact(emap, session, row, words, serials, cleared):
                if int(emap.rows[row, 0]) == session:  # the words it still holds go
                    self._clear(emap, row, session, words, serials)
                out.append(LeaseStatus.EXPIRED)
                continue
            self._clear(emap, row, session, words, serials)
            out.append(LeaseStatus.OK)
        return out

    def _clear(
        self, emap: ExtentMap, row: int, session: int, words: list[int], serials: list[int]
    ) -> None:
        pins = emap.rows[row]
        for word, serial in zip(words, serials, strict=True):
            if int(pins[ROW_HEAD + word]) == serial:
                pins[ROW_HEAD + word] = 0
        if self._row_of.get(session) == row:
            self._free[row].extend(words)  # a word the store cleared is free again too

    def renew(self, lease_id: int, ttl_s: float) -> float:
        """A pin has no TTL of its own: it holds while its session does, up to the store's
        lifetime bound. Answers the TTL the store would grant."""
        with self._lock:
            emap, held = self._map, self._leases.get(lease_id)
            alive = held is not None and emap is not None and _intact(emap, *held)
        if not alive or emap is None:
            raise KvtierError(ErrorCode.LEASE_EXPIRED, f"lease {lease_id:x} ended at the store")
        return min(ttl_s, emap.max_ttl_s)

    def close(self) -> None:
        """Let go of the region: leases made here end with the session the store still
        counts (this client's, which closes or times out)."""
        with self._lock:
            if self._map is None:
                return
            os.close(self._fd)
            self._map = None  # the numpy views go before the mapping can close
            self._leases.clear()
            mapped, self._mapped = self._mapped, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a reader still holds it
                mapped.close()


def _intact(
    emap: ExtentMap, session: int, row: int, words: list[int], serials: list[int], cleared: int
) -> bool:
    """The store still counts this lease's pins: its session's row, every word as written
    (checked word by word only when the store cleared any of the row's since)."""
    pins = emap.rows[row]
    if int(pins[0]) != session:
        return False
    if int(pins[2]) == cleared:
        return True
    return all(int(pins[ROW_HEAD + w]) == s for w, s in zip(words, serials, strict=True))


def _lock_shared(fd: int, wait_s: float = 0.002) -> bool:
    """The lock, shared, within ``wait_s`` (the store holds it exclusive for one operation;
    a store stopped holding it must not stall the engine)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.00005)


def owns(lease_id: int) -> bool:
    """A lease made by an engine itself (never sent to the store)."""
    return bool(lease_id & VIEW_LEASE)
