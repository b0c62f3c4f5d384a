"""Other nodes' pools as a staging tier: who else holds the rest of a prompt, pulled here.

After the node store's own run, the index is asked which *other* node store holds the run that
follows; the local store then pulls it from that holder (``fetch``: a lease at the holder, one
transfer batch, checksums verified on arrival, committed here), and the connector loads it
like any DRAM hit. The next request on this node hits locally.

Answers from the index are hints: a holder that no longer has the chunks answers HOLDER_MISS
and the index entry is repaired here; any failure (holder dead, stalled, refusing, bytes that
do not match their checksum) leaves the prompt's tail to recompute. Nothing here can block
vLLM's scheduler: it runs on the connector's lookup threads, under deadlines.

Threading: ``stage`` runs on several lookup threads; the holder-address cache is locked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.index.api import ChunkIndex, ChunkOp, LocationKind, Query
from kvtier.store.api.events import EventKind
from kvtier.store.api.remote import FetchStatus
from kvtier.tiers.base import PoolTier, StageResult, StageStatus, StagingTier

log = logging.getLogger(__name__)

ADDRESS_REFRESH_S = 10.0


class RemoteTier(StagingTier):
    name = "remote"

    def __init__(self, index: ChunkIndex, pool: PoolTier, fetch_timeout_s: float) -> None:
        self.index = index
        self.pool = pool
        self.fetch_timeout_s = fetch_timeout_s
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._addresses_at = 0.0
        self.disabled_reason = ""

    def close(self) -> None:
        self.index.close()

    def stage(self, ns_id: bytes, keys: Sequence[bytes], min_chunks: int) -> StageResult:
        """Make the longest possible leading run of ``keys`` local, from another node's store."""
        if self.disabled_reason or not keys:
            return StageResult(StageStatus.UNAVAILABLE, detail=self.disabled_reason)
        try:
            holding = self._best_holder(ns_id, keys)
        except KvtierError as exc:  # index unreachable or degraded: no remote tier right now
            log.debug("kvtier: index query failed: %s", exc)
            return StageResult(StageStatus.UNAVAILABLE, detail="index")
        if holding is None or holding[1] < min_chunks:
            return StageResult(StageStatus.NOT_HELD)
        location, run = holding
        address = self._address_of(location)
        if address is None:
            return StageResult(StageStatus.UNAVAILABLE, source=location, detail="unknown holder")
        start = time.perf_counter()
        try:
            result = self.pool.fetch(ns_id, keys[:run], address, self.fetch_timeout_s)
        except KvtierError as exc:
            if exc.code is ErrorCode.UNAVAILABLE and "remote tier" in exc.message:
                self.disabled_reason = exc.message  # the local store runs without it
                log.warning("kvtier: remote tier off: %s", exc.message)
                return StageResult(StageStatus.UNAVAILABLE, detail=exc.message)
            log.warning("kvtier: fetch from %s failed: %s", location, exc)
            return StageResult(StageStatus.FAILED, source=location, detail="error")
        seconds = time.perf_counter() - start
        if not result.ok:
            log.info(
                "kvtier: fetch of %d chunks from %s: %s after %d (%s)",
                run,
                location,
                result.status.value,
                result.local,
                result.message,
            )
        if result.status is FetchStatus.HOLDER_MISS:
            self._repair(location, ns_id, list(keys[result.holder_hits : run]))
        if result.ok:
            status = StageStatus.STAGED
        else:
            status = StageStatus.PARTIAL if result.local else StageStatus.FAILED
        return StageResult(
            status, result.local, result.bytes, seconds, location, result.status.value
        )

    def _best_holder(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[str, int] | None:
        own = self.pool.info.node_id
        answer = self.index.query_one(Query(ns_id, keys=tuple(keys)))
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
        except KvtierError as exc:
            log.debug("kvtier: index repair for %s failed: %s", location, exc)
