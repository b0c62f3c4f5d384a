"""What ``StoreCore`` holds, and the internal steps its operations share.

``StoreState`` owns the store's state (the page book with its chunk table and tenants, the
namespaces, the leases and sessions, the event log, the counters) and the steps every
operation reuses: reaping expired leases and sessions, ending a lease, checking ownership and
TTLs, noting when each namespace was last used and retiring the idle empty ones.
``StoreCore`` (``kvtier.store.state.core``) is the API on top: every public method there takes the
lock, then calls these. Split only to keep each file readable; one class in spirit.

Threading: nothing here takes the lock except ``stats`` and ``check_invariants``; the rest
runs under the caller's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TypeGuard

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.api.types import check_keys
from kvtier.store.state.entries import COUNTERS, ChunkEntry, ChunkState, NamespaceInfo
from kvtier.store.state.eventlog import EventLog
from kvtier.store.state.leases import Lease, LeaseKind, LeaseTable
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.pages import PageBook
from kvtier.store.state.quotas import Tenant, TenantBook
from kvtier.store.state.sessions import SessionTable


class StoreState:
    def __init__(
        self,
        *,
        node_id: str,
        epoch: int,
        capacity_bytes: int,
        page_size: int,
        eviction: str = "s3fifo",
        lease_ttl_s: float = 30.0,
        write_ttl_s: float = 60.0,
        max_lease_ttl_s: float = 600.0,
        event_buffer: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        limits: StoreLimits | None = None,
    ) -> None:
        """``limits``: the request, session and tenant bounds (``StoreLimits()``: no batch
        share cap and no quotas, the state machine's plain semantics)."""
        self.node_id = node_id
        self.epoch = epoch
        self.page_size = page_size
        num_pages = capacity_bytes // page_size
        self.capacity_bytes = num_pages * page_size
        self.lease_ttl_s = lease_ttl_s
        self.write_ttl_s = write_ttl_s
        self.max_lease_ttl_s = max_lease_ttl_s
        self.events = EventLog(node_id=node_id, epoch=epoch, capacity=event_buffer)
        self._clock = clock
        self._lock = threading.RLock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.limits = limits = limits or StoreLimits()
        self._tenants = TenantBook(page_size, num_pages, limits.tenants, limits.default_quota_bytes)
        self._book = PageBook(num_pages, page_size, eviction, self.counters, self._tenants)
        self._table = self._book.table  # the chunk table (key -> entry), owned by the book
        self._pages = self._book.pages
        self._alloc = self._book.alloc
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        # namespace id -> when it was last registered, looked up, allocated into (...), least
        # recently used first: where retirement looks (``_retire_idle_namespaces``)
        self._ns_used: OrderedDict[bytes, float] = OrderedDict()
        self._leases = LeaseTable()
        self._sessions = SessionTable(limits.session_timeout_s, limits.max_sessions)
        self._unsummed: deque[ChunkEntry] = deque()  # committed without a checksum

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            pages = self._pages
            committed_chunks = sum(
                1 for e in self._table.values() if e.state is ChunkState.COMMITTED
            )
            return {
                "node_id": self.node_id,
                "epoch": self.epoch,
                "capacity_bytes": self.capacity_bytes,
                "page_size": self.page_size,
                "eviction": self._book.policy.name,
                "used_bytes": self._alloc.used_pages * self.page_size,
                "free_bytes": self._alloc.free_pages * self.page_size,
                "committed_bytes": pages["committed"] * self.page_size,
                "pinned_bytes": pages["pinned"] * self.page_size,
                "writing_bytes": pages["writing"] * self.page_size,
                "doomed_bytes": pages["doomed"] * self.page_size,
                "quarantined_bytes": pages["quarantined"] * self.page_size,
                "largest_free_run_bytes": self._alloc.largest_free_run() * self.page_size,
                "chunks": committed_chunks,
                "writing_chunks": len(self._table) - committed_chunks,
                "namespaces": len(self._namespaces),
                "read_leases": self._leases.count(LeaseKind.READ),
                "write_leases": self._leases.count(LeaseKind.WRITE),
                "sessions": len(self._sessions),
                "event_seq": self.events.last_seq,
                **self.counters,
                **self._tenants.stats(),
            }

    def check_invariants(self) -> None:
        """Assert the page accounting adds up (tests and debug builds)."""
        with self._lock:
            pages = self._pages
            total = pages["committed"] + pages["writing"] + pages["doomed"] + pages["quarantined"]
            assert total == self._alloc.used_pages, (pages, self._alloc.used_pages)
            assert self._alloc.used_pages <= self._alloc.num_pages
            pinned = sum(
                e.pages
                for e in self._table.values()
                if e.state is ChunkState.COMMITTED and e.pins > 0
            )
            assert pinned == pages["pinned"], (pinned, pages)
            committed = [e for e in self._table.values() if e.state is ChunkState.COMMITTED]
            assert len(committed) == len(self._book.policy)
            assert all(e.key in self._book.policy for e in committed)
            tenants = self._tenants.all()
            for state in ("writing", "committed", "pinned"):
                assert sum(getattr(t, state) for t in tenants) == pages[state], (state, pages)
            for tenant in tenants:
                held = sum(e.pages for e in self._table.values() if e.tenant is tenant)
                assert held == tenant.held - _doomed_writing(self._leases, tenant), tenant
                assert tenant.quota is None or tenant.held <= tenant.quota, tenant
                assert tenant.namespaces == sum(
                    1 for i in self._namespaces.values() if i.tenant is tenant
                ), tenant
            # A namespace is retired only once nothing of it is left: every chunk's is known.
            assert self._ns_used.keys() == self._namespaces.keys()
            in_table: dict[bytes, int] = {}
            for entry in self._table.values():
                in_table[entry.namespace] = in_table.get(entry.namespace, 0) + 1
            live = self._book.live
            assert all(live.get(ns, 0) >= n for ns, n in in_table.items()), (in_table, live)
            assert all(n > 0 and ns in self._namespaces for ns, n in live.items()), live
            for lease in self._leases.all():
                assert all(e.namespace in live for e in lease.entries), lease.id

    # -- internals ---------------------------------------------------------------------------

    def _registered(self, ns_id: bytes) -> NamespaceInfo:
        """What ``ns_id`` was registered with (UNKNOWN_NAMESPACE: never, or retired)."""
        info = self._namespaces.get(ns_id)
        if info is None:
            raise unknown_namespace(ns_id)
        return info

    def _use_namespace(self, ns_id: bytes, now: float) -> NamespaceInfo:
        """The namespace ``ns_id`` (``_registered``), marked used ``now``: not retired for
        ``namespace_idle_s`` from now."""
        info = self._registered(ns_id)
        self._ns_used[ns_id] = now
        self._ns_used.move_to_end(ns_id)
        return info

    def _retire_idle_namespaces(self, now: float, limit: int | None = None) -> int:
        """Forget namespaces unused for ``namespace_idle_s`` that have no chunk left (none
        stored, being written, or pinned: ``PageBook.live``), least recently used first, at
        most ``limit``. Returns how many. A client still holding a retired id is answered
        UNKNOWN_NAMESPACE, as after a restart, and registers it again."""
        cutoff = now - self.limits.namespace_idle_s
        live = self._book.live
        retired: list[bytes] = []
        for ns_id, used in self._ns_used.items():
            if used > cutoff or (limit is not None and len(retired) >= limit):
                break  # the rest were used more recently
            if ns_id not in live:
                retired.append(ns_id)
        for ns_id in retired:
            del self._ns_used[ns_id]
            info = self._namespaces.pop(ns_id)
            info.tenant.namespaces -= 1
            self._tenants.forget(info.namespace.cache_salt)
        self.counters["namespaces_retired"] += len(retired)
        return len(retired)

    def _reap(self, now: float) -> None:
        self._book.release_quarantine(now)
        for lease in self._leases.pop_expired(now):
            self._end_lease(lease, "expired")
        for session in self._sessions.pop_expired(now):
            self.counters["sessions_expired"] += 1
            self._end_session(session)

    def _end_lease(self, lease: Lease, how: str) -> None:
        """Undo what a lease (already out of the table) held: unpin its chunks, or give back
        the pages it was writing. ``how`` names the counter: released, expired, ...

        A write lease the store ends itself (its TTL, or its session's) quarantines its pages
        instead of freeing them: the writer did not say it was done, and a late copy of its
        (a frozen store, a starved client) must not land in pages another writer owns by
        then, where that writer's commit would checksum it into its own chunk."""
        if lease.kind is LeaseKind.READ:
            self.counters[f"{how}_read"] += 1
            for entry in lease.entries:
                self._book.unpin(entry)
        else:
            self.counters[f"{how}_write"] += 1
            until = self._clock() + self.limits.ended_write_quarantine_s
            self._book.drop_writing(lease.entries, quarantine_until=until)

    def _end_session(self, session: int) -> int:
        leases = self._leases.pop_session(session)
        for lease in leases:
            self._end_lease(lease, "session_released")
        return len(leases)

    def _check_session(self, session: int) -> None:
        if session and session not in self._sessions:
            raise KvtierError(
                ErrorCode.UNKNOWN_SESSION,
                f"session {session:x} is not open (closed, or no heartbeat for "
                f"{self._sessions.timeout_s} s): open a new one",
            )

    def _new_lease(
        self, kind: LeaseKind, entries: list[ChunkEntry], now: float, ttl: float, session: int
    ) -> int:
        deadline = now + self.limits.max_lease_lifetime_s
        return self._leases.create(kind, entries, now + ttl, session, deadline).id

    def _emit_removed(self, entries: list[ChunkEntry]) -> None:
        by_ns: dict[bytes, list[bytes]] = {}
        for entry in entries:
            by_ns.setdefault(entry.namespace, []).append(entry.key)
        self.events.append(
            [StoreEvent(EventKind.REMOVED, ns, tuple(keys)) for ns, keys in by_ns.items()]
        )

    def _get_lease(self, lease_id: int, kind: LeaseKind | None = None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            if self._leases.was_expired(lease_id):
                raise KvtierError(ErrorCode.LEASE_EXPIRED, f"lease {lease_id} expired")
            raise KvtierError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is not held")
        if kind is not None and lease.kind is not kind:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"lease {lease_id} is a {lease.kind} lease"
            )
        return lease

    def _select(self, entries: list[ChunkEntry], keys: Sequence[bytes] | None) -> list[ChunkEntry]:
        if keys is None:
            return list(entries)
        check_keys(keys)
        by_key = {e.key: e for e in entries}
        missing = [k.hex() for k in keys if k not in by_key]
        if missing:
            raise KvtierError(ErrorCode.UNKNOWN_KEY, f"not in this lease: {', '.join(missing[:4])}")
        return [by_key[k] for k in keys]

    @staticmethod
    def _held_by(entry: ChunkEntry | None, ns_id: bytes) -> TypeGuard[ChunkEntry]:
        """Whether a chunk is held under namespace ``ns_id``. A chunk of another namespace
        answers as absent to that namespace's callers, never as an error: namespace ids are
        public (the index lists them), so anyone can compute another namespace's keys for a
        guessed prompt, and an answer that told "held elsewhere" from "absent" would say
        whether someone else holds that prompt (naming the owner would say whose)."""
        return entry is not None and entry.namespace == ns_id

    def _check_lease_room(self, session: int, chunks: int) -> None:
        """Refuse (LIMIT_EXCEEDED) a new lease of ``chunks`` chunks that would take
        ``session`` past ``max_leases_per_session`` or ``max_leased_chunks_per_session``:
        each lease costs the store memory (and pins), and nothing else bounds how many one
        client takes. Leases without a session (in-process callers: the remote tier, an
        embedded store) are the store's own work; the gRPC front requires a session. A call
        that would take no chunk (an allocate of stored keys) makes no lease: never refused."""
        if not session or not chunks:
            return
        leases, held = self._leases.held(session)
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

    def namespace_salt(self, ns_id: bytes) -> str | None:
        """The ``cache_salt`` (tenant) of namespace ``ns_id``, None when it is not registered
        (never, or retired). Without the lock: one dict read, and an id's salt never changes
        (the salt is part of what the id hashes)."""
        info = self._namespaces.get(ns_id)
        return None if info is None else info.namespace.cache_salt

    def _ttl(self, ttl_s: float) -> float:
        if not ttl_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"lease ttl must be > 0, got {ttl_s}")
        return min(ttl_s, self.max_lease_ttl_s)

    def _default_ttl(self, kind: LeaseKind) -> float:
        return self.lease_ttl_s if kind is LeaseKind.READ else self.write_ttl_s


def unknown_namespace(ns_id: bytes) -> KvtierError:
    """The one answer for a namespace a caller may not use: never registered, retired, or
    another tenant's (``kvtier.store.server.grpc.TenantGate``). One function, so that the
    messages stay byte-identical and no probe tells them apart."""
    return KvtierError(ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} is not registered")


def _doomed_writing(leases: LeaseTable, tenant: Tenant) -> int:
    """Pages of ``tenant`` still being written though deleted (counted until their lease ends)."""
    return sum(
        e.pages
        for lease in leases.all()
        if lease.kind is LeaseKind.WRITE
        for e in lease.entries
        if e.doomed and e.tenant is tenant
    )
