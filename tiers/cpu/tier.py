"""The CPU tier as a client sees it: a node store's control API plus its mapped pool segment.

``CpuTier`` turns the store's allocate/commit/lookup/release protocol into leases that copy
bytes directly between the caller's buffers and the shared segment:

    with tier.read(ns_id, keys) as lease:        # longest committed prefix, pinned
        for i in range(len(lease.hits)):
            lease.read_into(i, dst[i])
    lease.valid                                  # False: a copy may be torn, discard it

    tier.put(ns_id, keys, chunks)                # allocate -> copy -> commit (abort on error)

Threading: a ``CpuTier`` may be shared by threads; each lease belongs to one thread.
After a store restart the tier re-attaches to the new incarnation on the next call; results
say which incarnation their extents belong to.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import xxhash

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace
from kvtier.store.api import StoreClient, StoreInfo
from kvtier.store.leases import LeaseStatus
from kvtier.store.types import AllocateResult, AllocStatus, LookupResult
from kvtier.tiers.base import ChunkLocation, LookupStatus, SegmentRef
from kvtier.tiers.cpu.shm import SharedSegment
from kvtier.tiers.remote.types import FetchResult

log = logging.getLogger(__name__)

Buffer = np.ndarray | bytes | bytearray | memoryview
T = TypeVar("T")


def checksum_views(views: Sequence[np.ndarray]) -> int:
    """A chunk's checksum: XXH3-64 of its bytes (the concatenation of ``views``), with 0
    mapped to 1 because 0 means "not computed yet" in the store's metadata."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0]) or 1
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest() or 1


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
        tier: CpuTier,
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
        tier: CpuTier,
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


class CpuTier:
    """The node's DRAM tier: a store's control API plus its mapped pool segment.

    Every method that returns pool extents says which store incarnation (epoch) they belong
    to (``LookupResult.epoch``, ``AllocateResult.epoch``): after a store restart the tier
    re-attaches to the new incarnation, and extents of the old one must never be applied to
    the new segment. ``segment_ref(epoch)`` names the segment of that incarnation.

    Namespaces are registered through ``namespace_id`` and remembered (at most
    ``max_namespaces``, least recently used forgotten) so a restart re-registers them."""

    def __init__(
        self,
        store: StoreClient,
        segment: SharedSegment | None = None,
        max_namespaces: int = 4096,
    ) -> None:
        """``segment``: the store's own mapping when embedded; otherwise attached by name."""
        self.store = store
        self._lock = threading.Lock()
        self._segments: OrderedDict[int, SegmentRef] = OrderedDict()
        self._info: StoreInfo | None = None
        try:
            self._attach(store.info())
        except KvtierError as exc:  # a lazy client of a store not up yet: attach on first use
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
        self._owns_segment = segment is None
        self._segment = segment  # mapped on first use: control-only users never map the pool
        self._namespaces: OrderedDict[bytes, tuple[Namespace, int]] = OrderedDict()
        self._max_namespaces = max_namespaces
        self._ctl: ThreadPoolExecutor | None = None

    @property
    def info(self) -> StoreInfo:
        """The store incarnation attached to (attaching now if not yet: UNAVAILABLE while the
        store cannot be reached)."""
        info = self._info
        return info if info is not None else self.reattach()

    @property
    def epoch(self) -> int:
        """The incarnation this tier is attached to now (0: none yet)."""
        info = self._info
        return info.epoch if info is not None else 0

    def _attach(self, info: StoreInfo) -> None:
        self._info = info
        self._remember_segment(info)

    def segment_ref(self, epoch: int) -> SegmentRef | None:
        """The pool segment of store incarnation ``epoch`` (None: not one seen lately)."""
        with self._lock:
            return self._segments.get(epoch)

    def _remember_segment(self, info: StoreInfo) -> None:
        self._segments[info.epoch] = SegmentRef(info.segment_name, info.segment_size, info.epoch)
        while len(self._segments) > 8:
            self._segments.popitem(last=False)

    @property
    def segment(self) -> SharedSegment:
        if self._segment is None:
            info = self.info
            with self._lock:
                if self._segment is None:
                    self._segment = SharedSegment.attach(info.segment_name, info.segment_size)
        return self._segment

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace (again after every store restart, which this tier handles)."""
        ns_id = self._retrying(lambda: self.store.register_namespace(namespace, chunk_bytes))
        with self._lock:
            self._namespaces[ns_id] = (namespace, chunk_bytes)
            self._namespaces.move_to_end(ns_id)
            while len(self._namespaces) > self._max_namespaces:
                self._namespaces.popitem(last=False)
        return ns_id

    def namespace_id(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """``register_namespace``, without a call when this tier registered it already."""
        ns_id = namespace.root_key()
        with self._lock:
            known = self._namespaces.get(ns_id)
            if known is not None and known[1] == chunk_bytes:
                self._namespaces.move_to_end(ns_id)
                return ns_id
        return self.register_namespace(namespace, chunk_bytes)

    def forget_namespace(self, ns_id: bytes) -> None:
        """The store does not know ``ns_id`` (UNKNOWN_NAMESPACE): register it again next time."""
        with self._lock:
            self._namespaces.pop(ns_id, None)

    # -- the control API, typed (each returns what the store answered) ----------------------

    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> LookupResult:
        """Longest committed prefix of ``keys``, leased when ``lease_ttl_s`` is given. The
        extents belong to ``result.epoch``."""
        return self._retrying(lambda: self.store.lookup(ns_id, keys, lease_ttl_s))

    def allocate_chunks(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
    ) -> AllocateResult:
        """Reserve pool pages for ``keys`` under a write lease (``WriteLease`` wraps this for
        byte-level callers). The extents belong to ``result.epoch``."""
        return self._retrying(lambda: self.store.allocate(ns_id, keys, sizes, ttl_s))

    def commit(self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]) -> int:
        # Never retried after a restart: leases do not survive one.
        return self.store.commit(lease_id, keys, checksums)

    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int:
        return self.store.abort(lease_id, keys)

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        return self.store.release(lease_ids)

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        return self.store.renew(lease_id, ttl_s)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        return self._retrying(lambda: self.store.delete(ns_id, keys))

    def clear(self) -> int:
        return self._retrying(self.store.clear)

    def fetch(
        self, ns_id: bytes, keys: Sequence[bytes], holder: str, timeout_s: float | None = None
    ) -> FetchResult:
        return self._retrying(lambda: self.store.fetch(ns_id, keys, holder, timeout_s))

    def stats(self) -> dict[str, int | float | str]:
        return self.store.stats()

    # -- byte-level helpers ------------------------------------------------------------------

    def read(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> ReadLease:
        ttl = lease_ttl_s if lease_ttl_s is not None else 30.0
        result = self.lookup(ns_id, keys, ttl)
        segment = self._segment_of(result.epoch)
        return ReadLease(self, segment, result.hits, result.stop, result.lease_id)

    def prefix_length(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """How many leading chunks are committed (no lease taken)."""
        return len(self.lookup(ns_id, keys, None).hits)

    def allocate(
        self, ns_id: bytes, keys: Sequence[bytes], chunk_bytes: int, ttl_s: float | None = None
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
            with self._lock:
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

    def _retrying(self, call: Callable[[], T]) -> T:
        """Run a call that carries no lease; after a store restart (STALE_EPOCH) re-attach
        once and run it again. Calls on leases (commit, abort, release, renew) never retry:
        leases do not survive a restart."""
        if self._info is None:
            self.reattach()  # never attached (the store was down at start): now or UNAVAILABLE
        try:
            return call()
        except KvtierError as exc:
            if exc.code is not ErrorCode.STALE_EPOCH:
                raise
            self.reattach()
            return call()

    def reattach(self) -> StoreInfo:
        """Adopt the store's current incarnation and re-register the namespaces it lost."""
        with self._lock:
            info = self.store.reattach()
            if self._info is not None and info.epoch == self._info.epoch:
                return info
            old, self._segment = self._segment, None  # the new one maps on first use
            self._attach(info)
            namespaces = list(self._namespaces.values())
            if self._owns_segment and old is not None:
                old.close()
        for namespace, chunk_bytes in namespaces:
            try:
                self.store.register_namespace(namespace, chunk_bytes)
            except KvtierError as exc:
                log.warning("re-registering a namespace after a restart failed: %s", exc)
        log.info("re-attached to store %s epoch %016x", info.node_id, info.epoch)
        return info

    def close(self) -> None:
        """Unmap the pool and close the store client (which stops an embedded store)."""
        if self._ctl is not None:
            self._ctl.shutdown(wait=True)
        if self._owns_segment and self._segment is not None:
            self._segment.close()
        self.store.close()

    def __enter__(self) -> CpuTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else len(memoryview(buf).cast("B"))
