"""The node store's control API, in two surfaces an embedded store and the gRPC client both
implement: ``StoreClient``, what an engine calls (through its tiers), and ``StoreAdmin``, what
operators, the index and peer stores call. Each caller holds the one it needs: a vLLM instance
can neither clear a shared pool nor read its event stream through its handle.

Data never goes through this API: it returns *where* chunks are in the pool's shared-memory
segment, and the caller copies bytes in or out itself (see ``kvtier.tiers.cpu``).

Protocol of a put:  ``allocate`` -> copy into the returned extents -> ``commit`` (or ``abort``).
Protocol of a get:  ``lookup(..., lease_ttl_s=...)`` -> copy out -> ``release``; the copy is
valid only if ``release`` answers ``LeaseStatus.OK``.
Sessions:           ``open_session`` -> pass ``session=`` to every lease-creating call
(``lookup``, ``allocate``, ``lease_for_peer``) -> ``heartbeat`` every
``StoreInfo.session_timeout_s / 3`` -> ``close_session``. When a session ends (closed, or no
heartbeat in time: the client died) the store ends its leases at once: read leases unpinned,
write leases aborted. Without a session (``session=0``) a lease lives until released or
expired, as an embedded store's do. ``GrpcStoreClient`` does all of this by itself.
Remote tier:        ``fetch(ns_id, keys, holder)`` pulls a run of chunks from another node's
store into this one; then get them as above (see ``kvtier.store.remote.fetch``). The holder's
side of it is ``StoreAdmin.lease_for_peer``.

Over gRPC the surfaces are permissions too (``kvtier.store.server.grpc.STORE_PERMISSIONS``):
the engine's calls are STORE_DATA (``info``: STORE_INFO); the admin surface's are STORE_ADMIN
(``clear``), STORE_OBSERVE (``stats``, ``snapshot``, ``read_events``) and STORE_PEER
(``lease_for_peer``).

Modules: this one (the interfaces), ``types`` (statuses and results), ``events`` (the event
stream's vocabulary), ``remote`` (what a fetch answers). Other packages import the store only
through ``kvtier.store.api`` and ``kvtier.store.client``.

Threading: implementations are thread-safe. Ownership: results are plain values; the client
owns nothing in the store except its leases, which expire if it dies.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.api.events import EventBatch, EventGap
from kvtier.store.api.remote import FetchResult
from kvtier.store.api.types import (
    AllocateCall,
    AllocateResult,
    CommitCall,
    LeaseStatus,
    LookupResult,
    Snapshot,
)

if TYPE_CHECKING:
    from kvtier.store.client.shm import SharedSegment


@dataclass(frozen=True, slots=True)
class StoreInfo:
    node_id: str
    epoch: int  # changes at every start: results from another epoch are void
    segment_name: str  # /dev/shm/<segment_name>
    segment_size: int
    page_size: int
    version: str
    transfer_address: str = ""  # remote tier: where peers reach this pool ("" = not served)
    transfer_base: int = 0  # remote tier: the pool's virtual address in the store's process
    lease_ttl_s: float = 30.0  # the store's default read-lease lifetime
    session_timeout_s: float = 0.0  # a session without heartbeat this long ends (0: no sessions)
    control_socket: str = ""  # the engine hot path's Unix socket (store.server.control; "": none)
    view_offset: int = 0  # where the view of committed chunks is in the segment (0: none)
    view_bytes: int = 0  # (kvtier.store.client.view)


class StoreHandle(abc.ABC):
    """What every caller of a node store holds: the incarnation it is attached to, and the
    connection (closed with ``close``)."""

    @abc.abstractmethod
    def info(self) -> StoreInfo: ...

    def reattach(self) -> StoreInfo:
        """After STALE_EPOCH: adopt the store's current incarnation and return its info. An
        in-process store never restarts under its client, so it just answers ``info()``."""
        return self.info()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (the store keeps running unless embedded)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreClient(StoreHandle):
    """The engine's surface of one node store: namespaces, leased lookups, writes, its own
    session, and pulls from other nodes (``kvtier.tiers`` is its one caller in the product)."""

    # How many of this client's sessions the store ended (no heartbeat got through, store
    # restarted): a lease taken before the count moved may be gone. 0 without sessions.
    sessions_ended: int = 0

    def local_segment(self) -> SharedSegment | None:
        """The pool's mapping when the store runs in this process (embedded), else None:
        clients then map the segment ``info()`` names."""
        return None

    def known_miss(self, ns_id: bytes, keys: Sequence[bytes], with_disk: bool = False) -> bool:
        """True when a lookup of ``keys`` is known to find nothing without asking the store
        (the store's shared view of its committed chunks says the first is absent; with
        ``with_disk``, a view that covers the disk tier says it is on neither). False: ask
        it. Never blocks on the store."""
        return False

    @abc.abstractmethod
    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace and its chunk size; returns the namespace id (its root key)."""

    @abc.abstractmethod
    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        """Longest committed prefix of ``keys``; leased when ``lease_ttl_s`` is given, the
        lease ending with ``session`` too (0: no session; UNKNOWN_SESSION: not open)."""

    @abc.abstractmethod
    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> AllocateResult:
        """Reserve pool pages for ``keys`` under a write lease (ending with ``session`` too).
        Batches are bounded: more than ``store.max_batch_keys`` keys is INVALID_ARGUMENT, more
        than ``store.max_batch_fraction`` of the pool that does not fit in free space is
        LIMIT_EXCEEDED; a tenant over its quota gets NO_SPACE for what does not fit."""

    @abc.abstractmethod
    def commit(
        self,
        lease_id: int,
        keys: Sequence[bytes] | None,
        checksums: Sequence[int],
        *,
        as_ns_id: bytes = b"",
        as_keys: Sequence[bytes] | None = None,
    ) -> int:
        """Make written chunks readable; ``as_keys``: placeholders commit under these names
        of ``as_ns_id`` (``StoreCore.commit``)."""

    @abc.abstractmethod
    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int: ...

    def allocate_many(
        self, calls: Sequence[AllocateCall], *, session: int = 0
    ) -> list[AllocateResult | KvtierError]:
        """Several allocations, in one message where the transport has one (the control
        socket's BATCH: an engine step's saves cost one round trip); each answered, or refused
        with its error, on its own. Here: one call after the other."""
        out: list[AllocateResult | KvtierError] = []
        for call in calls:
            try:
                out.append(self.allocate(call.ns_id, call.keys, call.sizes, session=session))
            except KvtierError as exc:
                out.append(exc)
        return out

    def commit_many(self, calls: Sequence[CommitCall]) -> list[int | KvtierError]:
        """Several commits, in one message where the transport has one (``allocate_many``)."""
        out: list[int | KvtierError] = []
        for call in calls:
            try:
                out.append(
                    self.commit(
                        call.lease_id,
                        call.keys,
                        call.checksums,
                        as_ns_id=call.as_ns_id,
                        as_keys=call.as_keys,
                    )
                )
            except KvtierError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]: ...

    @abc.abstractmethod
    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Extend a lease; returns its new TTL, shortened to what is left of its lifetime
        (``store.max_lease_lifetime_s`` from creation). LEASE_EXPIRED past that."""

    @abc.abstractmethod
    def open_session(self) -> int:
        """Open a client session; returns its id, to pass as ``session=`` to lease-creating
        calls. Heartbeat it within ``StoreInfo.session_timeout_s`` or it ends with its leases
        (LIMIT_EXCEEDED past ``store.max_sessions``)."""

    @abc.abstractmethod
    def heartbeat(self, session: int) -> bool:
        """Keep ``session`` alive. False: it is unknown or already ended (its leases are
        gone): the client must open a new one."""

    @abc.abstractmethod
    def close_session(self, session: int) -> int:
        """End ``session`` and every lease created under it; returns how many leases ended
        (0 for an unknown session)."""

    @abc.abstractmethod
    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """Remove chunks of ``ns_id`` (an engine drops chunks whose bytes failed their
        checksum); keys it does not hold are skipped."""

    def fetch(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        holder: str,
        timeout_s: float | None = None,
    ) -> FetchResult:
        """Pull ``keys`` (a prefix run) from the store at gRPC address ``holder`` into this
        store: one transfer batch, checksums verified, committed here. Peer failures are
        ``FetchResult.status``, not exceptions; bad arguments raise KvtierError. Returns
        within ``timeout_s`` (default ``remote.fetch_timeout_s``) plus one control call. A
        store without the remote tier answers UNAVAILABLE."""
        raise KvtierError(ErrorCode.UNAVAILABLE, f"{type(self).__name__} has no remote tier")

    def stage_from_disk(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        """Stage the leading run of ``keys`` this node's disk holds into the pool: read, each
        checksum verified, committed (``kvtier.store.disk``). A file that fails is dropped
        and ends the run; ``FetchResult.status`` says why (HOLDER_MISS: not on disk). Files
        not started within ``timeout_s`` are left. A store without the disk tier answers
        UNAVAILABLE."""
        raise KvtierError(ErrorCode.UNAVAILABLE, f"{type(self).__name__} has no disk tier")


class StoreAdmin(StoreHandle):
    """The operators', the index's and peer stores' surface of one node store: clearing it,
    its stats, its event stream (what the index follows), and the holder's side of a fetch."""

    @abc.abstractmethod
    def clear(self) -> int: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, int | float | str]: ...

    @abc.abstractmethod
    def snapshot(self) -> Snapshot: ...

    @abc.abstractmethod
    def read_events(
        self, from_seq: int, max_batches: int = 256, timeout: float | None = None
    ) -> list[EventBatch] | EventGap:
        """Event batches from ``from_seq`` on, or the gap if the store no longer has them."""

    def lease_for_peer(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        """Holder side of a fetch: ``lookup`` with a read lease whose hits all carry their
        checksum (computed on the spot if need be), for a peer's transfer engine to read. The
        lease ends with ``session`` too (the fetching store's session at the holder). A
        store without the remote tier answers UNAVAILABLE."""
        raise KvtierError(ErrorCode.UNAVAILABLE, f"{type(self).__name__} has no remote tier")
