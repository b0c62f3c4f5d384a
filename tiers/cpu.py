"""The node's DRAM pool as the connector sees it: the engine's surface of a store's API
(``StoreClient``) plus its mapped segment (``PoolTier``; byte-level helpers for other clients
in ``cpu_io.py``).

After a store restart the tier re-attaches to the new incarnation on the next call; results
say which incarnation their extents belong to. Threading: a ``CpuTier`` may be shared by
threads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.core.chunks import SegmentRef
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.api import StoreAdmin, StoreClient, StoreInfo
from kvtier.store.api.remote import FetchResult
from kvtier.store.api.types import (
    AllocateCall,
    AllocateResult,
    CommitCall,
    LeaseStatus,
    LookupResult,
)
from kvtier.store.client.shm import SharedSegment
from kvtier.tiers.cpu_io import PoolBytes

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["CpuTier"]


class CpuTier(PoolBytes):
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
        admin: StoreAdmin | None = None,
    ) -> None:
        """``segment``: the store's own mapping when embedded; otherwise attached by name.
        ``admin``: the store's admin surface, when this process owns it (embedded): what
        ``clear`` needs."""
        self.store = store
        self._admin = admin
        self._lock = threading.Lock()  # the maps below; never held across a store call
        self._reattach_lock = threading.Lock()  # one reattach at a time
        self._segments: OrderedDict[int, SegmentRef] = OrderedDict()
        self._info: StoreInfo | None = None
        try:
            self._attach(store.info())
        except KvtierError as exc:  # a lazy client of a store not up yet: attach on first use
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
        self._owns_segment = segment is None
        self._in_process = store.local_segment() is not None
        self._segment = segment  # mapped on first use: control-only users never map the pool
        self._namespaces: OrderedDict[bytes, tuple[Namespace, int]] = OrderedDict()
        self._max_namespaces = max_namespaces

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

    @property
    def embedded(self) -> bool:
        return self.store.local_segment() is not None

    @property
    def session_generation(self) -> int:
        """Moves whenever the store ended this client's session (its leases with it): a lease
        taken at another generation may be gone. Constant for an embedded store (no
        sessions: its leases end by TTL only, which the connector tracks itself)."""
        return self.store.sessions_ended

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
        known = self.registered_namespace_id(namespace, chunk_bytes)
        return known if known is not None else self.register_namespace(namespace, chunk_bytes)

    def registered_namespace_id(self, namespace: Namespace, chunk_bytes: int) -> bytes | None:
        ns_id = namespace.root_key()
        with self._lock:
            known = self._namespaces.get(ns_id)
            if known is None or known[1] != chunk_bytes:
                return None
            self._namespaces.move_to_end(ns_id)
            return ns_id

    def known_miss(self, ns_id: bytes, keys: Sequence[bytes], with_disk: bool = False) -> bool:
        # an embedded store's lookup is a call in this process: no view needed
        return not self._in_process and self.store.known_miss(ns_id, keys, with_disk)

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

    def allocate_many(self, calls: Sequence[AllocateCall]) -> list[AllocateResult | KvtierError]:
        """After a store restart (every answer STALE_EPOCH) re-attach once and ask again."""
        if self._info is None:
            self.reattach()
        results = self.store.allocate_many(calls)
        stale = [r for r in results if isinstance(r, KvtierError)]
        if stale and all(r.code is ErrorCode.STALE_EPOCH for r in stale):
            self.reattach()
            results = self.store.allocate_many(calls)
        return results

    def commit_many(self, calls: Sequence[CommitCall]) -> list[int | KvtierError]:
        return self.store.commit_many(calls)  # never retried: leases do not survive a restart

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
        admin = self._admin
        if admin is None:
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                "a shared node store is cleared by its operator (kvtier store), not by an engine",
            )
        return self._retrying(admin.clear)

    def fetch(
        self, ns_id: bytes, keys: Sequence[bytes], holder: str, timeout_s: float | None = None
    ) -> FetchResult:
        return self._retrying(lambda: self.store.fetch(ns_id, keys, holder, timeout_s))

    def stage_from_disk(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        return self._retrying(lambda: self.store.stage_from_disk(ns_id, keys, timeout_s))

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
        """Adopt the store's current incarnation and re-register the namespaces it lost.

        The store call (it may wait out a restarting store) holds only ``_reattach_lock``,
        never ``_lock``: the scheduler thread takes ``_lock`` (``segment_ref``) every step and
        must not wait behind the network."""
        with self._reattach_lock:
            info = self.store.reattach()
            with self._lock:
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
