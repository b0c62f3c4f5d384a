"""The store's side of the engines' pin table in the lease region
(``kvtier.store.client.view_leases`` has the protocol, ``lease_region`` the layout): rows
given to engine sessions, the region's lock taken exclusive, every pin read under it, the hit
rings drained, and pins past their lifetime cleared. Implements
``kvtier.store.state.view_pins.ViewPins``.

Threading: ``StoreCore`` calls it under the store's lock only.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Callable

import numpy as np

from kvtier.store.client.lease_region import ROW_HEAD, ExtentMap, word_of


class PinTable:
    """The store's side of the pin rows (``kvtier.store.state.view_pins.ViewPins``)."""

    def __init__(
        self,
        region: np.ndarray,
        lock_fd: int,
        lock_wait_s: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._map = ExtentMap(region)
        self.rows = self._map.rows
        self._fd = lock_fd
        self._lock_wait_s = lock_wait_s
        self._clock = clock
        self._row_of: dict[int, int] = {}  # session -> row
        # free rows by when they were freed: the longest free is reused first
        self._free: list[tuple[float, int]] = [(0.0, r) for r in range(self._map.shape.pin_slots)]
        self._cursor: dict[int, int] = {}  # row -> ring position read up to
        self._depth = 0
        self._pinned: set[int] | None = None
        self.lock_misses = 0  # sections that ran without the lock (an engine held it)
        # (row, word) -> (serial, when the store first saw it): what outlives its lifetime
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}
        self.expired = 0  # pins the store cleared at store.max_lease_lifetime_s

    def has_row(self, session: int) -> bool:
        return session in self._row_of

    def assign(self, session: int) -> None:
        if session in self._row_of or not self._free:
            return  # no row free: this session's leases go through the store
        self._free.sort()
        _, row = self._free.pop(0)
        self.rows[row, 1:] = 0
        self._cursor[row] = 0
        self.rows[row, 0] = word_of(session)
        self._row_of[session] = row

    def session_ended(self, session: int) -> None:
        row = self._row_of.pop(session, None)
        if row is None:
            return
        self.rows[row, 0] = 0  # first: a client that looks now finds its row gone
        self.rows[row, 1:] = 0
        self._cursor.pop(row, None)
        self._free.append((self._clock(), row))

    def begin(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        deadline = time.monotonic() + self._lock_wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self._pinned = None
                    self.lock_misses += 1
                    return
                time.sleep(0.00005)
            except OSError:  # closed under a last reap: the store is shutting down
                self._pinned = None
                return
        self._pinned = self.holding()

    def end(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._pinned is not None:
            self._pinned = None
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def pinned(self, serial: int) -> bool:
        """Held by an engine's pin (True whenever that is not known: outside a section, or
        one that ran without the lock)."""
        return self._pinned is None or serial in self._pinned

    def holding(self) -> set[int]:
        """The serials pinned now (rows of open sessions only)."""
        rows = [r for r in self._row_of.values()]
        if not rows:
            return set()
        pins = self.rows[rows, ROW_HEAD : ROW_HEAD + self._map.shape.pins]
        return set(pins[pins != 0].tolist())

    def expire(self, lifetime_s: float) -> None:
        """Clear the pins held longer than ``lifetime_s`` (inside a section with the lock: no
        engine is between reading the map and writing its pin). Their leases answer EXPIRED;
        the pages they held are the pool's again."""
        if self._pinned is None:
            return
        now = self._clock()
        seen: dict[tuple[int, int], tuple[int, float]] = {}
        pins_at = ROW_HEAD
        for row in self._row_of.values():
            words = self.rows[row, pins_at : pins_at + self._map.shape.pins]
            for word in np.flatnonzero(words).tolist():
                serial = int(words[word])
                first = self._seen.get((row, word))
                since = first[1] if first is not None and first[0] == serial else now
                if now - since >= lifetime_s:
                    words[word] = 0
                    self.rows[row, 2] += np.uint64(1)  # its lease must look word by word
                    self.expired += 1
                    self._pinned.discard(serial)
                    continue
                seen[(row, word)] = (serial, since)
        self._seen = seen

    def take_touches(self) -> list[int]:
        """The serials engines hit since the last call (inside a section with the lock only:
        a ring read beside a writer could see a head before its entries)."""
        if self._pinned is None:
            return []
        ring = self._map.shape.ring
        ring_at = ROW_HEAD + self._map.shape.pins
        out: list[int] = []
        for row in self._row_of.values():
            head = int(self.rows[row, 1])
            start = max(self._cursor.get(row, 0), head - ring)
            out.extend(int(self.rows[row, ring_at + i % ring]) for i in range(start, head))
            self._cursor[row] = head
        return out
