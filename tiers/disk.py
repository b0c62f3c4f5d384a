"""The node's local disk as a staging tier: chunks the DRAM pool let go, read back into it.

The node store copies cold chunks to files before eviction drops them from DRAM
(``kvtier.store.disk``); when a prompt's run in the pool ends, this tier asks the store to
stage the chunks that follow from its disk (``StageFromDisk``: files read in parallel, every
checksum verified, committed in the pool), and the connector loads them like any DRAM hit.
The store does the I/O, so one node's engines share one disk cache and no engine needs
access to the files.

A file that fails (missing, torn, corrupted, EIO) ends the run there and is dropped: the rest
of the prompt recomputes. A stage is bounded by ``connector.disk_timeout_s`` (files not
started by then are left to recompute), and never tried where it is measured to be no faster
than recomputing: with ``connector.kappa_file`` (``kvtier bench tier-latency --kappa-out``,
measured on this hardware) a run whose length has a disk kappa of 0 is not staged.

Threading: ``stage`` runs on several lookup threads; it holds no state of its own but the
reason the tier was turned off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtier.core.costs import KappaTable
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.remote import FetchStatus
from kvtier.tiers.base import PoolTier, StageResult, StageStatus, StagingTier

log = logging.getLogger(__name__)


class DiskTier(StagingTier):
    name = "disk"
    stages_in_rounds = True  # one stage allocates at most store.max_batch_fraction of the pool

    def __init__(
        self,
        pool: PoolTier,
        timeout_s: float,
        costs: KappaTable | None = None,
        chunk_tokens: int = 256,
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.costs = costs if costs is not None and costs.knows("disk") else None
        self.chunk_tokens = chunk_tokens
        self.disabled_reason = ""

    def worth_staging(self, chunks: int) -> bool:
        """False where the measured table says a disk hit of this length saves nothing."""
        return self.costs is None or self.costs.kappa("disk", chunks * self.chunk_tokens) > 0

    def stage(self, ns_id: bytes, keys: Sequence[bytes], min_chunks: int) -> StageResult:
        if self.disabled_reason or not keys:
            return StageResult(StageStatus.UNAVAILABLE, detail=self.disabled_reason)
        if not self.worth_staging(len(keys)):
            return StageResult(StageStatus.NOT_HELD, source="disk", detail="slower than recompute")
        start = time.perf_counter()
        try:
            result = self.pool.stage_from_disk(ns_id, keys, self.timeout_s)
        except KvtierError as exc:
            if exc.code is ErrorCode.UNAVAILABLE and "disk tier" in exc.message:
                self.disabled_reason = exc.message  # the store runs without one
                log.warning("kvtier: disk tier off: %s", exc.message)
                return StageResult(StageStatus.UNAVAILABLE, detail=exc.message)
            log.warning("kvtier: stage from disk failed: %s", exc)
            return StageResult(StageStatus.FAILED, source="disk", detail="error")
        seconds = time.perf_counter() - start
        if result.local == 0 and result.holder_hits < min_chunks:
            return StageResult(StageStatus.NOT_HELD, seconds=seconds, source="disk")
        if result.ok:
            status = StageStatus.STAGED
        elif result.status is FetchStatus.HOLDER_MISS:
            status = StageStatus.STAGED if result.local else StageStatus.NOT_HELD
        else:
            status = StageStatus.PARTIAL if result.local else StageStatus.FAILED
        return StageResult(status, result.local, result.bytes, seconds, "disk", result.status.value)
