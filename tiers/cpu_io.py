"""Byte-level access to the node pool, for clients that are not vLLM: tests, the demo,
benchmarks, tools. ``CpuTier`` (``tiers/cpu.py``) gains these through ``PoolBytes``:

    with tier.read(ns_id, keys) as lease:        # longest committed prefix, pinned
        for i in range(len(lease.hits)):
            lease.read_into(i, dst[i])
    lease.valid                                  # False: a copy may be torn, discard it

    tier.put(ns_id, keys, chunks)                # allocate -> copy -> commit (abort on error)

Threading: each lease belongs to one thread.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.core.chunks import ChunkLocation, LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.client.shm import SharedSegment, checksum_views
from kvtier.tiers.base import PoolTier

log = logging.getLogger(__name__)

Buffer = np.ndarray | bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int  # written and committed now
    existed: int  # already in the pool (idempotent put)
    skipped: int  # not stored: no space, or another writer is storing it


class ReadLease:
    """Chunks pinned for reading. Copy out, then ``release()``; trust copies only if it
    returns True (``valid``)."""

    def __init__(
        self,
        tier: PoolBytes,
        segment: SharedSegment,
        hits: list[ChunkLocation],
        stop: LookupStatus,
        lease_id: int,
    ) -> None:
        self._tier = tier
        self._segment = segment
        self.hits = hits
        self.stop = stop
        self.lease_id = lease_id
        self.valid: bool | None = None  # set by release()

    def __len__(self) -> int:
        return len(self.hits)

    def views(self, i: int) -> list[np.ndarray]:
        return self._segment.views(self.hits[i].extents)

    def read_into(self, i: int, dst: np.ndarray | bytearray) -> None:
        self._segment.read_into(self.hits[i].extents, dst)

    def read(self, i: int) -> bytes:
        return self._segment.read(self.hits[i].extents)

    def verify(self, i: int) -> bool | None:
        """Check chunk i's bytes in the pool against its checksum; None if the store has not
        computed that checksum yet."""
        if not self.hits[i].checksum:
            return None
        return checksum_views(self.views(i)) == self.hits[i].checksum

    def release(self) -> bool:
        if self.valid is None:
            self.valid = self._tier._release(self.lease_id) if self.lease_id else True
        return self.valid

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class WriteLease:
    """Chunks allocated for writing. Write every ALLOCATED chunk, then ``commit()``;
    ``abort()`` (or an exception inside ``with``) gives the pages back."""

    def __init__(
        self,
        tier: PoolBytes,
        segment: SharedSegment,
        keys: Sequence[bytes],
        statuses: list[AllocStatus],
        locations: list[ChunkLocation | None],
        lease_id: int,
    ) -> None:
        self._tier = tier
        self._segment = segment
        self.keys = list(keys)
        self.statuses = statuses
        self.locations = locations
        self.lease_id = lease_id
        self._checksums: dict[int, int] = {}
        self._done = lease_id == 0

    @property
    def allocated(self) -> list[int]:
        """Indices (into the keys asked for) of chunks to write."""
        return [i for i, s in enumerate(self.statuses) if s is AllocStatus.ALLOCATED]

    def views(self, i: int) -> list[np.ndarray]:
        loc = self.locations[i]
        if loc is None:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"chunk {i} was not allocated")
        return self._segment.views(loc.extents)

    def write(self, i: int, src: Buffer, checksum: int = 0) -> None:
        """Copy ``src`` into chunk i. Pass its checksum if you already know it (e.g. verified
        on arrival); otherwise the store computes it after commit, off this path."""
        loc = self.locations[i]
        if loc is None:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"chunk {i} was not allocated")
        self._segment.write(loc.extents, src)
        if checksum:
            self._checksums[i] = checksum

    def commit(self) -> int:
        """Commit every allocated chunk. Returns how many became readable."""
        if self._done:
            return 0
        idx = self.allocated
        sums = [self._checksums.get(i, 0) for i in idx]
        self._done = True
        return self._tier.commit(self.lease_id, None, sums)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._tier.abort(self.lease_id)
            except KvtierError as exc:  # expired or store gone: nothing left to give back
                log.debug("abort of lease %d: %s", self.lease_id, exc)

    def __enter__(self) -> WriteLease:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.commit()


class PoolBytes(PoolTier):
    """Byte-level helpers over any ``PoolTier`` that maps its segment (``CpuTier`` is one)."""

    _ctl: ThreadPoolExecutor | None = None  # one thread for control calls beside copies
    _ctl_lock = threading.Lock()

    @property
    @abc.abstractmethod
    def segment(self) -> SharedSegment:
        """The current incarnation's pool, mapped."""

    def read(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> ReadLease:
        ttl = lease_ttl_s if lease_ttl_s is not None else self.info.lease_ttl_s
        result = self.lookup(ns_id, keys, ttl)
        segment = self._segment_of(result.epoch)
        return ReadLease(self, segment, result.hits, result.stop, result.lease_id)

    def prefix_length(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """How many leading chunks are committed (no lease taken)."""
        return len(self.lookup(ns_id, keys, None).hits)

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        chunk_bytes: int,
        ttl_s: float | None = None,
    ) -> WriteLease:
        result = self.allocate_chunks(ns_id, keys, [chunk_bytes] * len(keys), ttl_s)
        segment = self._segment_of(result.epoch)
        return WriteLease(self, segment, keys, result.statuses, result.locations, result.lease_id)

    def put(self, ns_id: bytes, keys: Sequence[bytes], chunks: Sequence[Buffer]) -> PutResult:
        """Store whole chunks (all the namespace's chunk size). Idempotent per key."""
        if len(keys) != len(chunks):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys, {len(chunks)} chunks")
        if not keys:
            return PutResult(0, 0, 0)
        sizes = {_nbytes(c) for c in chunks}
        if len(sizes) != 1:
            raise KvtierError(ErrorCode.WRONG_SIZE, f"chunks of one put differ in size: {sizes}")
        with self.allocate(ns_id, keys, sizes.pop()) as lease:
            for i in lease.allocated:
                lease.write(i, chunks[i])
        stored = len(lease.allocated)
        existed = lease.statuses.count(AllocStatus.EXISTS)
        return PutResult(stored, existed, len(keys) - stored - existed)

    def put_stream(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        chunks: Sequence[Buffer],
        batch_bytes: int = 64 << 20,
    ) -> PutResult:
        """``put`` for many chunks, pipelined: the next batch's allocation and the previous
        batch's commit travel while this batch is copied, so control round trips hide behind
        memcpy. Batches commit independently (a failure loses only its own batch)."""
        if len(keys) != len(chunks):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys, {len(chunks)} chunks")
        if not keys:
            return PutResult(0, 0, 0)
        size = _nbytes(chunks[0])
        if any(_nbytes(c) != size for c in chunks):
            raise KvtierError(ErrorCode.WRONG_SIZE, "chunks of one put differ in size")
        step = max(1, batch_bytes // max(size, 1))
        starts = list(range(0, len(keys), step))
        ctl = self._control()
        pending = ctl.submit(self.allocate, ns_id, keys[:step], size)
        commits, stored, existed = [], 0, 0
        for n, start in enumerate(starts):
            lease = pending.result()
            if n + 1 < len(starts):
                nxt = starts[n + 1]
                pending = ctl.submit(self.allocate, ns_id, keys[nxt : nxt + step], size)
            try:
                for i in lease.allocated:
                    lease.write(i, chunks[start + i])
            except BaseException:
                lease.abort()
                raise
            commits.append(ctl.submit(lease.commit))
            stored += len(lease.allocated)
            existed += lease.statuses.count(AllocStatus.EXISTS)
        for commit in commits:
            commit.result()
        return PutResult(stored, existed, len(keys) - stored - existed)

    def get_stream_into(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        dsts: Sequence[np.ndarray | bytearray],
        batch_bytes: int = 64 << 20,
        chunk_bytes: int | None = None,
    ) -> int:
        """Copy the longest stored prefix of ``keys`` into ``dsts``, pipelined like
        ``put_stream``. Returns how many leading chunks were copied under valid leases."""
        if len(keys) != len(dsts):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys, {len(dsts)} dsts")
        if not keys:
            return 0
        size = chunk_bytes or _nbytes(dsts[0])
        step = max(1, batch_bytes // max(size, 1))
        ctl = self._control()
        pending = ctl.submit(self.read, ns_id, keys[:step])
        releases, copied = [], 0
        for start in range(0, len(keys), step):
            lease = pending.result()
            full = len(lease) == len(keys[start : start + step])
            nxt = start + step
            if full and nxt < len(keys):
                pending = ctl.submit(self.read, ns_id, keys[nxt : nxt + step])
            for i in range(len(lease)):
                lease.read_into(i, dsts[start + i])
            releases.append((ctl.submit(lease.release), len(lease)))
            if not full:
                break
        for release, count in releases:  # the prefix holds up to the first lost lease
            if not release.result():
                break
            copied += count
        return copied

    def _control(self) -> ThreadPoolExecutor:
        """One thread for control calls that overlap data copies (created on first use)."""
        if self._ctl is None:
            with self._ctl_lock:
                if self._ctl is None:
                    self._ctl = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tier-ctl")
        return self._ctl

    def get(self, ns_id: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """Copies of the longest stored prefix of ``keys`` (convenience; tests and demos)."""
        with self.read(ns_id, keys) as lease:
            out = [lease.read(i) for i in range(len(lease))]
        if not lease.valid:
            raise KvtierError(ErrorCode.LEASE_EXPIRED, "read lease expired during the copy")
        return out

    def _segment_of(self, epoch: int) -> SharedSegment:
        """The mapped pool of incarnation ``epoch``; STALE_EPOCH if that is not the current one
        (the store restarted between the call and now: its extents are void)."""
        segment = self.segment
        if epoch and epoch != self.epoch:
            raise KvtierError(ErrorCode.STALE_EPOCH, "store restarted during the call")
        return segment

    def _release(self, lease_id: int) -> bool:
        try:
            status = self.release([lease_id])[0]
        except KvtierError as exc:
            log.warning("releasing read lease %d failed: %s", lease_id, exc)
            return False
        return status is LeaseStatus.OK


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else len(memoryview(buf).cast("B"))
