"""The index's change feed: every write it applied, in order, for in-process replicas.

A router decides in well under a millisecond only if it does not ask the index over the
network per request (one gRPC round trip here costs ~1.3 ms, docs/router.md). So the router
keeps a replica of the index in its own process (``index/client/replica.py``): it loads a
snapshot, then follows this feed, and answers its queries locally. The index service stays
the source of truth the engines and stores write to and ask.

- ``FeedingIndex`` wraps the backend of ``kvtier index serve``: each write that changed
  something (a namespace, a registration, an unregister or drop, an applied batch, a replace,
  a heartbeat) is appended to the feed under one lock with the write itself, so the feed's
  order is the order the backend applied them in, and replaying it on a copy of the
  snapshot gives the same state.
- ``ChangeFeed`` keeps the newest ``capacity`` changes, numbered from 1, under a random
  ``epoch`` per index process. A reader asks for the changes after the last it applied and
  hears ``gap`` when it must load a snapshot again: another epoch (the index restarted), or
  changes it missed that the ring no longer holds.
- A snapshot (``IndexDump``) is taken under the same lock, with the number of the last change
  it includes.

Only a backend that can dump itself feeds (the memory backend). Replicas of the index that
share a Redis each apply the writes of the sources they claimed, so one process's feed would
be part of the picture; there the feed is refused with that reason and routers query.

Threading: writes and snapshots serialize on ``FeedingIndex``'s lock (the memory backend
serializes them on its own lock anyway); ``ChangeFeed.read`` may run on any number of
threads and waits on a condition for changes newer than the reader's.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Mapping, Sequence

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.index.api import (
    ApplyStatus,
    ChunkIndex,
    ChunkOp,
    ForwardingIndex,
    HeartbeatStatus,
    LocationInfo,
    Registration,
)
from kvtier.index.client.changes import (
    NO_FEED,
    Change,
    ChangeKind,
    Dumpable,
    FeedBatch,
    IndexDump,
    RouterShare,
)


class ChangeFeed:
    def __init__(self, capacity: int = 1 << 16, max_keys: int = 1 << 22) -> None:
        """At most ``capacity`` changes and ``max_keys`` chunk keys in them (4 Mi: ~100 MB
        of keys and tuples; the oldest changes go first)."""
        self.epoch = secrets.token_hex(8)
        self.capacity, self.max_keys = capacity, max_keys
        self._changes: deque[Change] = deque()
        self._sizes: deque[int] = deque()  # keys of each change, in step with _changes
        self._keys = 0
        self._last = 0
        self._new = threading.Condition()

    @property
    def last(self) -> int:
        return self._last

    def append(self, kind: ChangeKind, **fields: object) -> None:
        with self._new:
            self._last += 1
            change = Change(self._last, kind, **fields)  # type: ignore[arg-type]
            size = _keys_in(change)
            self._changes.append(change)
            self._sizes.append(size)
            self._keys += size
            while len(self._changes) > self.capacity or (
                self._keys > self.max_keys and len(self._changes) > 1
            ):
                self._changes.popleft()
                self._keys -= self._sizes.popleft()
            self._new.notify_all()

    def read(self, epoch: str, after: int, limit: int, wait_s: float = 0.0) -> FeedBatch:
        """Changes after ``after`` (at most ``limit``), waiting up to ``wait_s`` for one when
        the reader is current."""
        with self._new:
            if epoch == self.epoch and after == self._last and wait_s > 0:
                self._new.wait_for(lambda: self._last > after, timeout=wait_s)
            oldest = self._changes[0].seq if self._changes else self._last + 1
            if epoch != self.epoch or after > self._last or after + 1 < oldest:
                return FeedBatch(self.epoch, [], self._last, gap=True)
            start = after + 1 - oldest
            out = [self._changes[i] for i in range(start, min(len(self._changes), start + limit))]
            return FeedBatch(self.epoch, out, self._last)


class FeedingIndex(ForwardingIndex):
    """The backend of ``kvtier index serve``, appending each write it applied to ``feed``."""

    def __init__(self, inner: ChunkIndex, feed: ChangeFeed) -> None:
        super().__init__(inner)
        self.feed = feed
        self._lock = threading.Lock()

    @property
    def feeds(self) -> bool:
        return hasattr(self.inner, "dump")

    def snapshot(self) -> IndexDump:
        if not self.feeds:
            raise KvtierError(ErrorCode.UNSUPPORTED, NO_FEED)
        with self._lock:
            backend: Dumpable = self.inner  # type: ignore[assignment]
            namespaces, locations = backend.dump()
            return IndexDump(self.feed.epoch, self.feed.last, namespaces, locations)

    def follow(self, epoch: str, after: int, limit: int = 4096, wait_s: float = 0.0) -> FeedBatch:
        """The feed read in this process (``GrpcIndexClient.follow`` across a socket)."""
        return self.feed.read(epoch, after, limit, wait_s)

    def share(self, share: RouterShare) -> None:
        """A router replica's share relayed to the others (``Share`` across a socket)."""
        self.feed.append(ChangeKind.ROUTER, share=share)

    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        with self._lock:
            ns_id = self.inner.register_namespace(namespace)
            self.feed.append(ChangeKind.NAMESPACE, namespace=namespace)
            return ns_id

    def register(self, registration: Registration) -> LocationInfo:
        with self._lock:
            info = self.inner.register(registration)
            self.feed.append(
                ChangeKind.REGISTER, location=registration.location, registration=registration
            )
            return info

    def unregister(self, location: str) -> bool:
        with self._lock:
            existed = self.inner.unregister(location)
            if existed:
                self.feed.append(ChangeKind.UNREGISTER, location=location)
            return existed

    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        with self._lock:
            statuses = self.inner.heartbeat(locations)
            known = tuple(
                name
                for name, status in zip(locations, statuses, strict=True)
                if status is not HeartbeatStatus.UNKNOWN
            )
            if known:
                self.feed.append(ChangeKind.HEARTBEAT, locations=known)
            return statuses

    def drop(self, location: str) -> bool:
        with self._lock:
            existed = self.inner.drop(location)
            if existed:
                self.feed.append(ChangeKind.DROP, location=location)
            return existed

    def reap(self, timeout_s: float) -> list[str]:
        with self._lock:
            dropped = self.inner.reap(timeout_s)
            for location in dropped:
                self.feed.append(ChangeKind.DROP, location=location)
            return dropped

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        with self._lock:
            status = self.inner.apply(location, ops, epoch=epoch, seq_from=seq_from, seq_to=seq_to)
            if status is ApplyStatus.APPLIED:
                self.feed.append(ChangeKind.APPLY, location=location, ops=tuple(ops))
            return status

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        with self._lock:
            self.inner.replace(location, holdings, epoch=epoch, seq=seq)
            self.feed.append(ChangeKind.REPLACE, location=location, holdings=holdings)


def _keys_in(change: Change) -> int:
    keys = sum(len(op.keys) for op in change.ops)
    if change.holdings:
        keys += sum(len(k) for by_ns in change.holdings.values() for k in by_ns.values())
    if change.share is not None:
        keys += sum(len(k) for _, _, k in change.share.routed)
    return keys
