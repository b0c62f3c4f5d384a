"""The index in the router's own process: a copy kept current from the index's change feed.

A routing decision that asks the index over gRPC pays a round trip (~1.3 ms here, more under
load) on every request. ``IndexReplica`` loads a snapshot of the index service into a
``MemoryIndex`` and follows its change feed (``index/server/feed.py``) on a thread of its own, so
the decision's query is a local call (tens of µs). The index service stays the source of
truth: engines and stores write to it and ask it; only routers read a copy.

How stale the copy may be, and what a stale answer costs:

- While following, the copy trails the index by one feed round trip (a change is sent as
  soon as the index applied it: the follower waits on the index for the next one).
- The copy answers only while its last contact with the feed is at most ``max_stale_s``
  old. Past that (the index is unreachable, the follower fell behind), decisions ask the
  index directly as without a replica (``IndexGate``'s deadline; then by load alone), until
  the follower is current again.
- A stale answer mis-scores a route (an instance credited with chunks it evicted a moment
  ago, or not yet with ones it just stored): the request goes to a worse instance, never
  gets a wrong token; an engine's own lookup decides what it loads.

A gap (the index restarted: another feed epoch; or the follower missed more changes than the
feed keeps) loads a snapshot again. An index that keeps no feed (index replicas sharing a
Redis) answers UNSUPPORTED: the replica says why once and the router queries the index.

Threading: the follower thread writes the copy (``MemoryIndex`` is thread-safe); any number
of decision threads read it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.index.api import ChunkIndex, ForwardingIndex, LocationInfo, Query, QueryResult
from kvtier.index.backends.memory import MemoryIndex
from kvtier.index.client.changes import Change, ChangeKind, FeedBatch, IndexDump, RouterShare

log = logging.getLogger(__name__)

RETRY_S = 0.5  # after a failed contact with the index


class FeedSource(Protocol):
    """What the replica follows: ``GrpcIndexClient`` (or an index in this process, in tests)."""

    def follow(
        self, epoch: str, after: int, limit: int = ..., wait_s: float = ...
    ) -> FeedBatch: ...

    def snapshot(self) -> IndexDump: ...

    def share(self, share: RouterShare) -> None: ...


class IndexReplica(ForwardingIndex):
    def __init__(
        self,
        source: ChunkIndex,
        max_stale_s: float = 2.0,
        wait_s: float = 1.0,
        start: bool = True,
    ) -> None:
        """``source``: the index service's client (a ``FeedSource``); what the copy cannot
        answer goes to it. ``wait_s``: how long one follow call waits for a change."""
        super().__init__(source)
        self.feed: FeedSource = source  # type: ignore[assignment]
        self.max_stale_s = max_stale_s
        self.wait_s = wait_s
        self.copy = MemoryIndex()
        self.epoch = ""  # the feed the copy follows ('' until a snapshot is loaded)
        self.seq = 0  # the last change applied
        self.snapshots = 0  # loaded, since start
        self.unsupported: str | None = None  # why the index keeps no feed
        # the other router replicas' shares, as they arrive (router/peers.py)
        self.on_share: Callable[[RouterShare], None] | None = None
        self._contact: float | None = None  # monotonic: last follow reply with nothing left
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-index-replica", daemon=True)
        if start:
            self._thread.start()

    # -- reads: the copy while fresh ----------------------------------------------------------

    def fresh(self) -> bool:
        contact = self._contact
        return contact is not None and time.monotonic() - contact <= self.max_stale_s

    def lag_s(self) -> float | None:
        """Seconds since the copy was last known current (None: never)."""
        return None if self._contact is None else time.monotonic() - self._contact

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        return (self.copy if self.fresh() else self.inner).query(queries)

    def namespaces(self) -> dict[bytes, Namespace | None]:
        return (self.copy if self.fresh() else self.inner).namespaces()

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        return (self.copy if self.fresh() else self.inner).namespace(ns_id)

    def locations(self) -> list[LocationInfo]:
        return (self.copy if self.fresh() else self.inner).locations()

    def location(self, name: str) -> LocationInfo | None:
        return (self.copy if self.fresh() else self.inner).location(name)

    def share(self, share: RouterShare) -> None:
        """Relay this router replica's share to the others, through the index."""
        self.feed.share(share)

    def replica_state(self) -> dict[str, Any]:
        lag = self.lag_s()
        return {
            "fresh": self.fresh(),
            "lag_s": round(lag, 3) if lag is not None else None,
            "epoch": self.epoch,
            "seq": self.seq,
            "snapshots": self.snapshots,
            "unsupported": self.unsupported,
        }

    # -- following ----------------------------------------------------------------------------

    def sync_once(self) -> None:
        """One step of the follower: a snapshot when the copy has none (or hit a gap), else
        the next changes (waiting up to ``wait_s`` for one)."""
        if not self.epoch:
            self._load(self.feed.snapshot())
            return
        batch = self.feed.follow(self.epoch, self.seq, wait_s=self.wait_s)
        if batch.gap:
            log.info("kvtier router: the index's feed has a gap: loading a snapshot again")
            self.epoch = ""
            return
        for change in batch.changes:
            if change.seq != self.seq + 1:  # never skip one: reload instead
                self.epoch = ""
                return
            self._apply(change)
            self.seq = change.seq
        if self.seq >= batch.last:
            self._contact = time.monotonic()

    def _load(self, dump: IndexDump) -> None:
        self.copy.load(dump.namespaces, dump.locations)
        self.epoch, self.seq = dump.epoch, dump.seq
        self.snapshots += 1
        self._contact = time.monotonic()  # current as of the snapshot

    def _apply(self, change: Change) -> None:
        copy = self.copy
        kind = change.kind
        if kind is ChangeKind.NAMESPACE:
            assert change.namespace is not None
            copy.register_namespace(change.namespace)
        elif kind is ChangeKind.REGISTER:
            assert change.registration is not None
            copy.register(change.registration)
        elif kind is ChangeKind.UNREGISTER:
            copy.unregister(change.location)
        elif kind is ChangeKind.DROP:
            copy.drop(change.location)
        elif kind is ChangeKind.APPLY:
            copy.apply(change.location, change.ops)  # the feed's order is the order
        elif kind is ChangeKind.REPLACE:
            copy.replace(change.location, change.holdings or {}, epoch=0, seq=0)
        elif kind is ChangeKind.ROUTER:
            if self.on_share is not None and change.share is not None:
                self.on_share(change.share)
        else:
            copy.heartbeat(change.locations)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except KvtierError as exc:
                if exc.code in (
                    ErrorCode.UNSUPPORTED,
                    ErrorCode.PERMISSION_DENIED,
                    ErrorCode.UNAUTHENTICATED,
                ):  # no feed, or a credential that may not follow it: ask the index instead
                    self.unsupported = exc.message
                    log.warning("kvtier router: no index replica, queries go to the index: %s", exc)
                    return
                log.info("kvtier router: index feed: %s", exc)
                self.epoch = self.epoch if exc.code is ErrorCode.UNAVAILABLE else ""
                self._stop.wait(RETRY_S)
            except Exception:  # a change the copy refused: start over from a snapshot
                log.exception("kvtier router: index replica lost its place: reloading")
                self.epoch = ""
                self._stop.wait(RETRY_S)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.wait_s + 5)
        self.inner.close()
