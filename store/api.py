"""The node store's control API, one interface for the embedded store and the gRPC client.

Data never goes through this API: it returns *where* chunks are in the pool's shared-memory
segment, and the caller copies bytes in or out itself (see ``kvtier.tiers.cpu.tier``).

Protocol of a put:  ``allocate`` -> copy into the returned extents -> ``commit`` (or ``abort``).
Protocol of a get:  ``lookup(..., lease_ttl_s=...)`` -> copy out -> ``release``; the copy is
valid only if ``release`` answers ``LeaseStatus.OK``.
Remote tier:        ``fetch(ns_id, keys, holder)`` pulls a run of chunks from another node's
store into this one; then get them as above (see ``kvtier.tiers.remote.fetch``).

Threading: implementations are thread-safe. Ownership: results are plain values; the client
owns nothing in the store except its leases, which expire if it dies.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace
from kvtier.store.events import EventBatch, EventGap
from kvtier.store.leases import LeaseStatus
from kvtier.store.types import AllocateResult, LookupResult, Snapshot
from kvtier.tiers.remote.types import FetchResult


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


class StoreClient(abc.ABC):
    """Control plane of one node store."""

    @abc.abstractmethod
    def info(self) -> StoreInfo: ...

    def reattach(self) -> StoreInfo:
        """After STALE_EPOCH: adopt the store's current incarnation and return its info. An
        in-process store never restarts under its client, so it just answers ``info()``."""
        return self.info()

    @abc.abstractmethod
    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace and its chunk size; returns the namespace id (its root key)."""

    @abc.abstractmethod
    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> LookupResult:
        """Longest committed prefix of ``keys``; leased when ``lease_ttl_s`` is given."""

    @abc.abstractmethod
    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
    ) -> AllocateResult: ...

    @abc.abstractmethod
    def commit(
        self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]
    ) -> int: ...

    @abc.abstractmethod
    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int: ...

    @abc.abstractmethod
    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]: ...

    @abc.abstractmethod
    def renew(self, lease_id: int, ttl_s: float | None = None) -> float: ...

    @abc.abstractmethod
    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int: ...

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

    # -- remote tier (a store without it answers UNAVAILABLE) -------------------------------

    def lease_for_peer(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> LookupResult:
        """Holder side of a fetch: ``lookup`` with a read lease whose hits all carry their
        checksum (computed on the spot if need be), for a peer's transfer engine to read."""
        raise KvtierError(ErrorCode.UNAVAILABLE, f"{type(self).__name__} has no remote tier")

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
        within ``timeout_s`` (default ``remote.fetch_timeout_s``) plus one control call."""
        raise KvtierError(ErrorCode.UNAVAILABLE, f"{type(self).__name__} has no remote tier")

    def subscribe(self, from_seq: int = 1, poll_s: float = 1.0) -> Iterator[EventBatch | EventGap]:
        """Follow the event stream forever (until the store closes)."""
        seq = from_seq
        while True:
            got = self.read_events(seq, timeout=poll_s)
            if isinstance(got, EventGap):
                yield got
                return
            for batch in got:
                yield batch
                seq = batch.seq + 1

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (the store keeps running unless embedded)."""

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
