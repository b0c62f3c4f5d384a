"""Leases: time-bounded claims on chunks, so a client that dies leaks nothing.

A read lease pins committed chunks between lookup and copy-out; a write lease owns chunks
between allocate and commit. Both expire. An expired read lease unpins its chunks (they may
then be evicted, so the holder must treat its copy as invalid: ``release`` says so); an
expired write lease frees what was never committed.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
import heapq
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.types import ChunkEntry


class LeaseKind(enum.StrEnum):
    READ = "read"
    WRITE = "write"


class LeaseStatus(enum.StrEnum):
    OK = "ok"  # released in time: everything read under it was stable
    EXPIRED = "expired"  # reaped before release: a copy made under it may be torn
    UNKNOWN = "unknown"  # never issued by this store incarnation (or released twice)


@dataclass(slots=True)
class Lease:
    id: int
    kind: LeaseKind
    entries: list[ChunkEntry]
    expires: float


@dataclass
class LeaseTable:
    _leases: dict[int, Lease] = field(default_factory=dict)
    _expiry_heap: list[tuple[float, int]] = field(default_factory=list)
    # Ids of leases reaped recently, so a late release can be told EXPIRED, not UNKNOWN.
    _expired: dict[int, None] = field(default_factory=dict)
    _expired_keep: int = 65536

    def __len__(self) -> int:
        return len(self._leases)

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind is kind)

    def create(self, kind: LeaseKind, entries: list[ChunkEntry], expires: float) -> Lease:
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, kind, entries, expires)
        self._leases[lease_id] = lease
        heapq.heappush(self._expiry_heap, (expires, lease_id))
        return lease

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def was_expired(self, lease_id: int) -> bool:
        return lease_id in self._expired

    def pop(self, lease_id: int) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def renew(self, lease: Lease, expires: float) -> None:
        lease.expires = expires
        heapq.heappush(self._expiry_heap, (expires, lease.id))

    def pop_expired(self, now: float) -> list[Lease]:
        """Remove and return every lease whose expiry has passed."""
        out: list[Lease] = []
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expires, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires != expires:
                continue  # released, or renewed (a newer heap entry exists)
            del self._leases[lease_id]
            self._expired[lease_id] = None
            out.append(lease)
        while len(self._expired) > self._expired_keep:
            del self._expired[next(iter(self._expired))]
        return out

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def clear(self) -> None:
        self._leases.clear()
        self._expiry_heap.clear()
