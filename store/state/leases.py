"""Leases: time-bounded claims on chunks, so a client that dies leaks nothing.

A read lease pins committed chunks between lookup and copy-out; a write lease owns chunks
between allocate and commit. Both expire. An expired read lease unpins its chunks (they may
then be evicted, so the holder must treat its copy as invalid: ``release`` says so); an
expired write lease gives back what was never committed, its pages quarantined (the writer
may still be copying).

A lease may belong to a client session (``kvtier.store.state.sessions``): it then also ends with
the session (``end_session``), which is how a killed client's pins go within seconds. Its
``deadline`` caps its whole life, renewals included (``store.max_lease_lifetime_s``), so no
client can pin chunks forever by renewing. What one session holds is bounded
(``check_room``).

``LeaseTable`` is the store's leases and their rules: TTLs, lifetimes, per-session bounds, and
what ending one undoes in the page book (``kvtier.store.state.pages``).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import check_keys
from kvtier.store.api.types import LeaseStatus
from kvtier.store.state.entries import ChunkEntry
from kvtier.store.state.ids import RandomIds
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.pages import PageBook
from kvtier.store.state.quotas import Tenant


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

    def select(self, keys: Sequence[bytes] | None) -> list[ChunkEntry]:
        """Its chunks named by ``keys`` (all of them for None); UNKNOWN_KEY for a key it does
        not hold."""
        if keys is None:
            return list(self.entries)
        check_keys(keys)
        by_key = {e.key: e for e in self.entries}
        missing = [k.hex() for k in keys if k not in by_key]
        if missing:
            raise KvtierError(ErrorCode.UNKNOWN_KEY, f"not in this lease: {', '.join(missing[:4])}")
        return [by_key[k] for k in keys]

    def drop(self, entries: list[ChunkEntry]) -> None:
        """Take ``entries`` (committed or aborted) out of the lease."""
        chosen = set(map(id, entries))
        self.entries = [e for e in self.entries if id(e) not in chosen]


class LeaseTable:
    def __init__(
        self,
        pages: PageBook,
        limits: StoreLimits,
        counters: dict[str, int],
        clock: Callable[[], float],
        *,
        read_ttl_s: float = 30.0,
        write_ttl_s: float = 60.0,
        max_ttl_s: float = 600.0,
    ) -> None:
        """``read_ttl_s`` / ``write_ttl_s``: a lease's TTL when none is asked for;
        ``max_ttl_s``: the longest one granted at a time."""
        self.pages = pages
        self.limits = limits
        self.counters = counters  # the store's (released_read, expired_write, ...)
        self._clock = clock
        self.read_ttl_s = read_ttl_s
        self.write_ttl_s = write_ttl_s
        self.max_ttl_s = max_ttl_s
        self._leases: dict[int, Lease] = {}
        self._ids = RandomIds()
        self._expiry_heap: list[tuple[float, int]] = []
        # Ids of leases reaped recently, so a late release can be told EXPIRED, not UNKNOWN.
        self._expired: dict[int, None] = {}
        self._expired_keep = 65536
        self._by_session: dict[int, set[int]] = {}  # session -> lease ids
        self._chunks_by_session: dict[int, int] = {}  # session -> weights

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
        lease_id = self._ids.draw()
        while lease_id in self._leases:
            lease_id = self._ids.draw()
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

    # -- the rules ---------------------------------------------------------------------------

    def ttl(self, ttl_s: float) -> float:
        """A TTL asked for, capped at ``max_ttl_s`` (INVALID_ARGUMENT unless > 0)."""
        if not ttl_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"lease ttl must be > 0, got {ttl_s}")
        return min(ttl_s, self.max_ttl_s)

    def default_ttl(self, kind: LeaseKind) -> float:
        return self.read_ttl_s if kind is LeaseKind.READ else self.write_ttl_s

    def check_room(self, session: int, chunks: int) -> None:
        """Refuse (LIMIT_EXCEEDED) a new lease of ``chunks`` chunks that would take
        ``session`` past ``max_leases_per_session`` or ``max_leased_chunks_per_session``:
        each lease costs the store memory (and pins), and nothing else bounds how many one
        client takes. Leases without a session (in-process callers: the remote tier, an
        embedded store) are the store's own work; the gRPC front requires a session. A call
        that would take no chunk (an allocate of stored keys) makes no lease: never refused."""
        if not session or not chunks:
            return
        leases, held = self.held(session)
        limits = self.limits
        if leases >= limits.max_leases_per_session:
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"session {session:x} holds {leases} leases: store.max_leases_per_session = "
                f"{limits.max_leases_per_session} (release leases no longer needed)",
            )
        if held + chunks > limits.max_leased_chunks_per_session:
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"session {session:x} holds {held} chunks under leases, {chunks} more asked: "
                f"store.max_leased_chunks_per_session = "
                f"{limits.max_leased_chunks_per_session} (release leases no longer needed)",
            )

    def grant(
        self, kind: LeaseKind, entries: list[ChunkEntry], now: float, ttl: float, session: int
    ) -> Lease:
        """A new lease of ``ttl`` (already capped) that lives at most
        ``max_lease_lifetime_s`` and ends with ``session`` too."""
        deadline = now + self.limits.max_lease_lifetime_s
        return self.create(kind, entries, now + ttl, session, deadline)

    def granted(self, ttl: float) -> float:
        """Seconds a new lease of ``ttl`` is granted for (what its lifetime leaves)."""
        return min(ttl, self.limits.max_lease_lifetime_s)

    def require(self, lease_id: int, kind: LeaseKind | None = None) -> Lease:
        """The held lease ``lease_id`` (LEASE_EXPIRED, UNKNOWN_LEASE; INVALID_ARGUMENT if it
        is not of ``kind``)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            if lease_id in self._expired:
                raise KvtierError(ErrorCode.LEASE_EXPIRED, f"lease {lease_id} expired")
            raise KvtierError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is not held")
        if kind is not None and lease.kind is not kind:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"lease {lease_id} is a {lease.kind} lease"
            )
        return lease

    def extend(self, lease_id: int, ttl_s: float | None, now: float) -> float:
        """Renew a lease; returns seconds until its new expiry (what its lifetime leaves)."""
        lease = self.require(lease_id)
        ttl = self.ttl(ttl_s if ttl_s is not None else self.default_ttl(lease.kind))
        self.renew(lease, now + ttl)
        return lease.expires - now

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End leases at their holder's word: OK, or EXPIRED (ended meanwhile, also with its
        session: what it guarded may have changed), or UNKNOWN."""
        out = []
        for lease_id in lease_ids:
            lease = self.pop(lease_id)
            if lease is None:
                expired = lease_id in self._expired
                out.append(LeaseStatus.EXPIRED if expired else LeaseStatus.UNKNOWN)
                continue
            self.end(lease, "released")
            out.append(LeaseStatus.OK)
        return out

    def expire(self, now: float) -> None:
        """End every lease whose expiry has passed."""
        for lease in self.pop_expired(now):
            self.end(lease, "expired")

    def end_session(self, session: int) -> int:
        """End every lease of ``session``; returns how many."""
        leases = self.pop_session(session)
        for lease in leases:
            self.end(lease, "session_released")
        return len(leases)

    def end(self, lease: Lease, how: str) -> None:
        """Undo what a lease (already out of the table) held: unpin its chunks, or give back
        the pages it was writing. ``how`` names the counter: released, expired, ...

        A write lease the store ends itself (its TTL, or its session's) quarantines its pages
        instead of freeing them: the writer did not say it was done, and a late copy of its
        (a frozen store, a starved client) must not land in pages another writer owns by
        then, where that writer's commit would checksum it into its own chunk."""
        if lease.kind is LeaseKind.READ:
            self.counters[f"{how}_read"] += 1
            for entry in lease.entries:
                self.pages.unpin(entry)
        else:
            self.counters[f"{how}_write"] += 1
            until = self._clock() + self.limits.ended_write_quarantine_s
            self.pages.drop_writing(lease.entries, quarantine_until=until)

    def stats(self) -> dict[str, int]:
        return {
            "read_leases": self.count(LeaseKind.READ),
            "write_leases": self.count(LeaseKind.WRITE),
        }

    def doomed_writing(self, tenant: Tenant) -> int:
        """Pages of ``tenant`` still being written though deleted (counted until their lease
        ends)."""
        return sum(
            e.pages
            for lease in self._leases.values()
            if lease.kind is LeaseKind.WRITE
            for e in lease.entries
            if e.doomed and e.tenant is tenant
        )
