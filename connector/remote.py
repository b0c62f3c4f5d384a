"""The connector's remote tier: who else holds the rest of a prompt, and pulling it here.

After the node store's own run, the index is asked which *other* node store holds the run that
follows; the local store then pulls it from that holder (``StoreClient.fetch``: lease at the
holder, one transfer batch, checksums verified on arrival, committed here), and the connector
loads it like any DRAM hit. The next request on this node hits locally.

Answers from the index are hints: a holder that no longer has the chunks answers HOLDER_MISS
and the index entry is repaired here; any failure (holder dead, stalled, refusing, bytes that
do not match their checksum) leaves the prompt's tail to recompute. Nothing here can block
vLLM's scheduler: it runs on the connector's lookup threads, under deadlines.

Threading: used from lookup threads; the holder-address cache is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.connector.counters import C, Counter, fetch_status_counter
from kvtier.errors import ErrorCode, KvtierError
from kvtier.index.api import ChunkIndex, ChunkOp, LocationKind, Query
from kvtier.store.events import EventKind
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu.tier import CpuTier
from kvtier.tiers.remote.types import FetchStatus

log = logging.getLogger(__name__)

ADDRESS_REFRESH_S = 10.0


@dataclass(frozen=True)
class RemoteRun:
    holder: str  # the holder's location name in the index (its store's node id)
    chunks: int  # chunks of ``keys`` the fetch made local (a prefix)
    status: FetchStatus


class RemoteResolver:
    def __init__(self, index: ChunkIndex, tier: CpuTier, fetch_timeout_s: float) -> None:
        self.index = index
        self.tier = tier
        self.fetch_timeout_s = fetch_timeout_s
        self._count: Callable[[Counter, float], None] = lambda counter, value: None
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._addresses_at = 0.0
        self.disabled_reason = ""

    def bind_stats(self, count: Callable[[Counter, float], None]) -> None:
        self._count = count

    def close(self) -> None:
        self.index.close()

    def pull(self, ns_id: bytes, keys: list[bytes], min_chunks: int) -> RemoteRun | None:
        """Make the longest possible leading run of ``keys`` local, from another node's store.
        None when no other node holds at least ``min_chunks`` of them (or on any failure)."""
        if self.disabled_reason or not keys:
            return None
        try:
            holding = self._best_holder(ns_id, keys)
        except KvtierError as exc:  # index unreachable or degraded: no remote tier right now
            self._count(C.REMOTE_INDEX_ERRORS, 1)
            log.debug("kvtier: index query failed: %s", exc)
            return None
        if holding is None or holding[1] < min_chunks:
            return None
        location, run = holding
        address = self._address_of(location)
        if address is None:
            self._count(C.REMOTE_UNKNOWN_HOLDERS, 1)
            return None
        start = time.perf_counter()
        try:
            result = self.tier.fetch(ns_id, keys[:run], address, self.fetch_timeout_s)
        except KvtierError as exc:
            if exc.code is ErrorCode.UNAVAILABLE and "remote tier" in exc.message:
                self.disabled_reason = exc.message  # the local store runs without it
                log.warning("kvtier: remote tier off: %s", exc.message)
            else:
                self._count(C.REMOTE_FETCH_ERRORS, 1)
                log.warning("kvtier: fetch from %s failed: %s", location, exc)
            return None
        self._count(C.REMOTE_FETCH_SECONDS, time.perf_counter() - start)
        self._count(C.REMOTE_FETCHED_BYTES, result.bytes)
        if not result.ok:
            short = fetch_status_counter(result.status)
            if short is not None:
                self._count(short, 1)
            log.info(
                "kvtier: fetch of %d chunks from %s: %s after %d (%s)",
                run,
                location,
                result.status.value,
                result.local,
                result.message,
            )
        if result.status is FetchStatus.HOLDER_MISS:
            self._repair(location, ns_id, keys[result.holder_hits : run])
        return RemoteRun(location, result.local, result.status)

    def _best_holder(self, ns_id: bytes, keys: list[bytes]) -> tuple[str, int] | None:
        own = self.tier.info.node_id
        answer = self.index.query_one(Query(ns_id, keys=keys))
        best: tuple[str, int, float] | None = None
        for holding in answer.holdings:
            if holding.kind is not LocationKind.NODE or holding.location == own:
                continue
            run = holding.runs.get(Tier.CPU, 0)
            if run and (best is None or (run, holding.stored_at) > (best[1], best[2])):
                best = (holding.location, run, holding.stored_at)
        return None if best is None else (best[0], best[1])

    def _address_of(self, location: str) -> str | None:
        with self._lock:
            stale = time.monotonic() - self._addresses_at > ADDRESS_REFRESH_S
            if location not in self._addresses or stale:
                try:
                    self._addresses = {
                        info.registration.location: info.registration.endpoints["store"]
                        for info in self.index.locations()
                        if info.registration.endpoints.get("store")
                    }
                    self._addresses_at = time.monotonic()
                except KvtierError as exc:
                    log.debug("kvtier: cannot list index locations: %s", exc)
            return self._addresses.get(location)

    def _repair(self, location: str, ns_id: bytes, keys: list[bytes]) -> None:
        """The holder does not have what the index says: drop those entries (a hint gone
        stale; the holder's own events would remove them too, later)."""
        if not keys:
            return
        try:
            self.index.apply(location, [ChunkOp(EventKind.REMOVED, Tier.CPU, ns_id, tuple(keys))])
            self._count(C.REMOTE_INDEX_REPAIRS, 1)
        except KvtierError as exc:
            log.debug("kvtier: index repair for %s failed: %s", location, exc)
