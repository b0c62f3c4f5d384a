"""The store's event stream: what entered and left the pool, in order, with sequence numbers.

Every change to the set of committed chunks is one event inside a sequence-numbered batch.
Consumers (the index) read batches from a sequence number on; one that asks for a sequence
number the log no longer holds gets ``EventGap`` and recovers with a snapshot (see
``StoreCore.snapshot``), then reads on from the snapshot's sequence number.

Threading: ``EventLog`` is thread-safe; readers block on a condition until batches arrive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.store.api.events import EventBatch, EventGap, EventKind, StoreEvent

if TYPE_CHECKING:
    from kvtier.store.state.entries import ChunkEntry


@dataclass
class EventLog:
    node_id: str
    epoch: int
    capacity: int = 65536
    # called with every batch's events, in order, inside the log's lock (the store's view of
    # committed chunks, ``kvtier.store.client.view``, follows the log this way)
    observer: Callable[[Sequence[StoreEvent]], None] | None = None
    _batches: deque[EventBatch] = field(init=False)
    _next_seq: int = field(init=False, default=1)
    _cond: threading.Condition = field(init=False, default_factory=threading.Condition)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._batches = deque(maxlen=self.capacity)

    @property
    def lock(self) -> threading.Condition:
        """Held while a batch is appended (and its observer told): hold it to act between
        two batches."""
        return self._cond

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest batch (0 before the first)."""
        return self._next_seq - 1

    def append(self, events: list[StoreEvent]) -> int:
        if not events:
            return self.last_seq
        with self._cond:
            if self.observer is not None:
                self.observer(events)
            seq = self._next_seq
            self._next_seq += 1
            self._batches.append(
                EventBatch(self.node_id, self.epoch, seq, time.time(), tuple(events))
            )
            self._cond.notify_all()
            return seq

    def removed(self, entries: list[ChunkEntry]) -> None:
        """One batch saying ``entries`` left the pool (evicted, deleted), by namespace."""
        by_ns: dict[bytes, list[bytes]] = {}
        for entry in entries:
            by_ns.setdefault(entry.namespace, []).append(entry.key)
        self.append([StoreEvent(EventKind.REMOVED, ns, tuple(keys)) for ns, keys in by_ns.items()])

    def stored(self, keys: dict[bytes, list[bytes]]) -> None:
        """One batch saying ``keys`` (namespace id -> keys) became readable."""
        self.append([StoreEvent(EventKind.STORED, ns, tuple(ks)) for ns, ks in keys.items()])

    def read(
        self, from_seq: int, max_batches: int = 256, timeout: float | None = None
    ) -> list[EventBatch] | EventGap:
        """Batches with ``seq >= from_seq`` (waiting up to ``timeout`` for the first one)."""
        with self._cond:
            if timeout and from_seq >= self._next_seq and not self._closed:
                self._cond.wait_for(lambda: from_seq < self._next_seq or self._closed, timeout)
            if from_seq >= self._next_seq:
                return []
            oldest = self._batches[0].seq if self._batches else self._next_seq
            if from_seq < oldest:
                return EventGap(requested=from_seq, oldest=oldest)
            start = from_seq - oldest
            end = min(len(self._batches), start + max_batches)
            return [self._batches[i] for i in range(start, end)]

    def close(self) -> None:
        """Wake every blocked reader (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
