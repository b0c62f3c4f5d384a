"""Leases: time-bounded claims on chunks, so a client that dies leaks nothing.

A read lease pins committed chunks between lookup and copy-out; a write lease owns chunks
between allocate and commit. Both expire. An expired read lease unpins its chunks (they may
then be evicted, so the holder must treat its copy as invalid: ``release`` says so); an
expired write lease frees what was never committed.

A lease may belong to a client session (``kvtier.store.state.sessions``): it then also ends with
the session (``pop_session``), which is how a killed client's pins go within seconds. Its
``deadline`` caps its whole life, renewals included (``store.max_lease_lifetime_s``), so no
client can pin chunks forever by renewing.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
import heapq
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.state.entries import ChunkEntry


class LeaseKind(enum.StrEnum):
    READ = "read"
    WRITE = "write"


@dataclass(slots=True)
class Lease:
    id: int
    kind: LeaseKind
    entries: list[ChunkEntry]
    expires: float
    session: int = 0  # the client session it ends with (0: none, TTL only)
    deadline: float = math.inf  # it never lives past this, however renewed
    weight: int = 0  # chunks it held when created: what it counts against its session


@dataclass
class LeaseTable:
    _leases: dict[int, Lease] = field(default_factory=dict)
    _expiry_heap: list[tuple[float, int]] = field(default_factory=list)
    # Ids of leases reaped recently, so a late release can be told EXPIRED, not UNKNOWN.
    _expired: dict[int, None] = field(default_factory=dict)
    _expired_keep: int = 65536
    _by_session: dict[int, set[int]] = field(default_factory=dict)  # session -> lease ids
    _chunks_by_session: dict[int, int] = field(default_factory=dict)  # session -> weights

    def __len__(self) -> int:
        return len(self._leases)

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind is kind)

    def create(
        self,
        kind: LeaseKind,
        entries: list[ChunkEntry],
        expires: float,
        session: int = 0,
        deadline: float = math.inf,
    ) -> Lease:
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        expires = min(expires, deadline)
        lease = Lease(lease_id, kind, entries, expires, 0, deadline, len(entries))
        self._leases[lease_id] = lease
        heapq.heappush(self._expiry_heap, (expires, lease_id))
        self.bind(lease, session)
        return lease

    def bind(self, lease: Lease, session: int) -> None:
        """Make ``lease`` end with ``session`` too (0: no session)."""
        if session and not lease.session:
            lease.session = session
            self._by_session.setdefault(session, set()).add(lease.id)
            self._chunks_by_session[session] = self._chunks_by_session.get(session, 0) + (
                lease.weight
            )

    def held(self, session: int) -> tuple[int, int]:
        """(leases, chunks) that ``session`` holds: what its bounds are checked against. A
        lease's chunks are counted as it was created (a write lease that commits part of its
        chunks still counts them until it ends), each lease apart (one chunk pinned twice
        counts twice: each pin is an entry the store keeps)."""
        return len(self._by_session.get(session, ())), self._chunks_by_session.get(session, 0)

    def pop_session(self, session: int) -> list[Lease]:
        """Remove and return every lease of ``session`` (it ended). A late release of one is
        then told EXPIRED: what it guarded may have changed."""
        out = []
        self._chunks_by_session.pop(session, None)
        for lease_id in self._by_session.pop(session, ()):
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._expired[lease_id] = None
                out.append(lease)
        self._trim_expired()
        return out

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def was_expired(self, lease_id: int) -> bool:
        return lease_id in self._expired

    def pop(self, lease_id: int) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._unbind(lease)
        return lease

    def renew(self, lease: Lease, expires: float) -> None:
        lease.expires = min(expires, lease.deadline)
        heapq.heappush(self._expiry_heap, (lease.expires, lease.id))

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
            self._unbind(lease)
            self._expired[lease_id] = None
            out.append(lease)
        self._trim_expired()
        return out

    def _unbind(self, lease: Lease) -> None:
        if lease.session:
            ids = self._by_session.get(lease.session)
            if ids is not None and lease.id in ids:
                ids.discard(lease.id)
                self._chunks_by_session[lease.session] -= lease.weight
                if not ids:
                    del self._by_session[lease.session]
                    del self._chunks_by_session[lease.session]

    def _trim_expired(self) -> None:
        while len(self._expired) > self._expired_keep:
            del self._expired[next(iter(self._expired))]

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def clear(self) -> None:
        self._leases.clear()
        self._expiry_heap.clear()
        self._by_session.clear()
        self._chunks_by_session.clear()
