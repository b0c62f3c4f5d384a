"""The media the connector finds KV in, behind two small interfaces.

A load always copies from the node's shared DRAM pool: ``PoolTier`` is that pool's control
side (namespaces, lookups under read leases, space for saves). Farther media (another node's
pool; later a local disk) are never loaded from directly: a ``StagingTier`` brings a run of
chunks into the node pool, where the connector leases and loads them like any DRAM hit, so
the next request on the node hits locally. Adding a medium is one ``StagingTier`` module (and
the store backend that serves it); the connector's lookup walks the configured staging tiers
in order and names none of them.

Vocabulary (``Tier``, ``ChunkLocation``, ``SegmentRef``, ...) lives in ``kvtier.core.chunks``; the
results come from the store's API (``kvtier.store.api``).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.chunks import SegmentRef
from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.api import StoreInfo
from kvtier.store.api.remote import FetchResult
from kvtier.store.api.types import (
    AllocateCall,
    AllocateResult,
    CommitCall,
    LeaseStatus,
    LookupResult,
)


class PoolTier(abc.ABC):
    """The node's DRAM pool as the connector sees it (``tiers/cpu.py``).

    Pin contract: ``lookup(..., lease_ttl_s)`` pins the longest committed prefix under one
    read lease; pinned chunks are neither evicted nor changed until ``release`` or expiry, and
    ``renew`` extends it. Write contract: ``allocate_chunks`` reserves pages under a write
    lease; the caller writes them, then ``commit`` makes them readable (or ``abort`` gives
    them back); an expired write lease frees its pages and its commit fails.

    Sessions: the store may end every lease of this client at once (``session_generation``
    moves); write pages of leases ended that way are quarantined, not reused at once.

    Incarnations: every result carrying extents says which store incarnation (``epoch``) they
    belong to; after a restart the tier re-attaches, and ``segment_ref(epoch)`` names the
    segment of a given incarnation (None once forgotten). Extents are never valid in another
    incarnation's segment.

    Threading: every method may be called from any thread; calls on one lease are the
    caller's to order. Leases belong to the process that took them and die with it.
    """

    name = "cpu"

    @property
    @abc.abstractmethod
    def info(self) -> StoreInfo:
        """The incarnation attached to (attaching now if need be: UNAVAILABLE if down)."""

    @property
    @abc.abstractmethod
    def epoch(self) -> int:
        """The incarnation attached to now (0: none yet). Never blocks."""

    @property
    @abc.abstractmethod
    def embedded(self) -> bool:
        """The store runs in this process: its calls answer in microseconds, and it is this
        process's own (``clear`` is allowed)."""

    @property
    @abc.abstractmethod
    def session_generation(self) -> int:
        """Moves whenever the store ended this client's session, and every lease in it (no
        heartbeat got through for the store's session timeout): a lease taken at another
        generation may be gone whatever its TTL said. Never blocks."""

    @abc.abstractmethod
    def segment_ref(self, epoch: int) -> SegmentRef | None: ...

    @abc.abstractmethod
    def namespace_id(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """The namespace's id, registered with the store if this tier did not yet."""

    def registered_namespace_id(self, namespace: Namespace, chunk_bytes: int) -> bytes | None:
        """The namespace's id when this tier registered it already, else None (no call)."""
        return None

    def known_miss(self, ns_id: bytes, keys: Sequence[bytes], with_disk: bool = False) -> bool:
        """True when a lookup of ``keys`` is known to find nothing without a round trip (the
        store's shared view of its chunks; ``with_disk``: in the node's disk tier either).
        False: look up. Never blocks."""
        return False

    @abc.abstractmethod
    def forget_namespace(self, ns_id: bytes) -> None:
        """The store no longer knows ``ns_id``: register it again next time."""

    @abc.abstractmethod
    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> LookupResult:
        """Longest committed prefix of ``keys``, read-leased when ``lease_ttl_s`` is given."""

    @abc.abstractmethod
    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End read leases. OK: nothing read under it can have changed; EXPIRED: it may."""

    @abc.abstractmethod
    def renew(self, lease_id: int, ttl_s: float | None = None) -> float: ...

    @abc.abstractmethod
    def allocate_chunks(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
    ) -> AllocateResult:
        """Pages for chunks about to be written, evicting unpinned chunks as needed."""

    @abc.abstractmethod
    def allocate_many(self, calls: Sequence[AllocateCall]) -> list[AllocateResult | KvtierError]:
        """``allocate_chunks`` for several namespaces' chunks at once: one message to a store
        that takes batches (an engine step's saves), each answered or refused on its own."""

    @abc.abstractmethod
    def commit_many(self, calls: Sequence[CommitCall]) -> list[int | KvtierError]:
        """``commit`` of several leases at once (one message where the store takes batches)."""

    @abc.abstractmethod
    def commit(self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]) -> int:
        """Make written chunks readable (``keys=None``: the whole lease). Never retried after
        a store restart: leases do not survive one."""

    @abc.abstractmethod
    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int: ...

    @abc.abstractmethod
    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """Remove chunks (a pinned one is unlinked now, its pages freed at its last unpin)."""

    @abc.abstractmethod
    def fetch(
        self, ns_id: bytes, keys: Sequence[bytes], holder: str, timeout_s: float | None = None
    ) -> FetchResult:
        """Pull a leading run of ``keys`` from the node store at ``holder`` into this pool
        (committed, not leased): how the remote tier stages (``tiers/remote.py``). UNAVAILABLE
        when the store runs without the remote tier."""

    @abc.abstractmethod
    def stage_from_disk(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        """Stage a leading run of ``keys`` from the node's disk into this pool (committed,
        not leased): how the disk tier stages (``tiers/disk.py``). UNAVAILABLE when the store
        runs without the disk tier."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every chunk: only the pool of an ``embedded`` store (PERMISSION_DENIED for
        a shared one, which its operator clears)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class StageStatus(enum.StrEnum):
    """How a staging attempt ended (what the connector counts)."""

    STAGED = "staged"  # ``chunks`` leading keys are committed in the node pool now
    NOT_HELD = "not_held"  # no holder of at least ``min_chunks`` of them: nothing to do
    UNAVAILABLE = "unavailable"  # the medium (or what locates data in it) cannot be reached
    PARTIAL = "partial"  # some chunks staged, then the holder missed, failed or timed out
    FAILED = "failed"  # nothing staged: the transfer failed (the prompt recomputes)


@dataclass(frozen=True, slots=True)
class StageResult:
    status: StageStatus
    chunks: int = 0  # leading keys committed in the node pool now (not leased)
    bytes: int = 0  # bytes moved
    seconds: float = 0.0
    source: str = ""  # who held them (a node id, a disk path)
    detail: str = ""  # the medium's own reason (e.g. a fetch status), for counters and logs

    @property
    def staged(self) -> bool:
        return self.chunks > 0


class StagingTier(abc.ABC):
    """A medium farther than the node pool, read by staging chunks into it.

    ``stage`` makes the longest possible leading run of ``keys`` committed in the node pool
    (nothing is leased: the caller leases them with ``PoolTier.lookup``, and may find fewer
    if the pool evicted some meanwhile). It returns within its own deadline whatever the
    medium does (a dead or frozen holder costs at most that), never raises for a medium
    failure (only for bad arguments), and leaves the prompt's tail to recompute on any doubt.

    Threading: called from the connector's lookup threads, several at once.
    """

    name: str  # the tier's name in the connector's config (``tiers = ["cpu", "remote"]``)
    # True: a run shorter than asked may be the medium's bound on one call (the node store
    # stages at most ``store.max_batch_fraction`` of its pool per allocation), so the caller
    # asks again for the rest, cheaply (a call that finds nothing costs no transfer and no
    # deadline). False: a short run is the medium's answer (a remote holder's miss or fault,
    # which a second call would only pay for again).
    stages_in_rounds: bool = False

    @abc.abstractmethod
    def stage(self, ns_id: bytes, keys: Sequence[bytes], min_chunks: int) -> StageResult:
        """Stage a leading run of ``keys`` of at least ``min_chunks`` (else NOT_HELD)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the tier holds (connections); the medium keeps its data."""
