"""The store's state machine: which chunks the pool holds, where, and who may touch them.

``StoreCore`` owns metadata only; the bytes live in a shared-memory segment that clients copy
in and out of directly. Every chunk is WRITING (allocated, owned by a write lease) or
COMMITTED (readable). Rules enforced here:

- Capacity is never exceeded: pages are handed out by the allocator, which never over-commits.
- Eviction is synchronous with allocation: an allocation evicts until it fits, and fails only
  when not enough pages are free or evictable (everything else pinned or being written).
- Pinned (read-leased) and WRITING chunks are never evicted; a deleted chunk that is still
  pinned is unlinked at once (no new reader finds it) and its pages freed at the last unpin.
- Duplicate allocations of a stored key are idempotent: EXISTS, no second copy.
- A key held under another namespace answers as absent (``_held_by``): a lookup misses there,
  a delete skips it, an allocate answers NO_SPACE for it. Namespace ids are no secret, so
  anyone can compute another namespace's keys; an error naming the owner would tell whether
  someone else holds a prompt.
- Every lease expires, so a client that dies leaks nothing; a lease taken under a client
  session also ends with it (``kvtier.store.state.sessions``): a killed client's pins go within
  ``session_timeout_s``. No lease lives past ``max_lease_lifetime_s``, renewals included.
- One request is bounded (``kvtier.store.state.limits``): at most ``max_batch_keys`` keys, checked
  before the lock; an allocate asks for at most ``max_batch_fraction`` of the pool unless it
  fits in free space. A tenant holds at most its quota and keeps its floor
  (``kvtier.store.state.quotas``).
- Pages a failed remote transfer was writing are quarantined (``abort(..., quarantine_s=)``):
  out of the table at once, but not handed out again until the quarantine ends, because the
  transfer engine may still deliver late bytes into them.
- Namespaces are bounded (``max_namespaces``) but not forever: one that holds no chunk (none
  committed, being written or pinned) and that nobody registered, looked up, allocated into
  or deleted from for ``namespace_idle_s`` is retired, by the periodic ``reap`` and, least
  recently used first, by a registration that would exceed the bound. Its id then answers
  UNKNOWN_NAMESPACE, as after a restart, and its clients register it again. A namespace with
  chunks is never retired. A cache reset (``on_reset: bump``) starts a new generation of an
  instance's namespaces; the old generation goes this way once its chunks are evicted.

Threading: every public method takes the store's lock; call from any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvtier.core.chunks import ChunkLocation, LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.api.types import (
    AllocateResult,
    AllocStatus,
    LeaseStatus,
    LookupResult,
    Snapshot,
    check_keys,
)
from kvtier.store.state.corestate import StoreState
from kvtier.store.state.entries import ChunkEntry, ChunkState, NamespaceInfo
from kvtier.store.state.leases import LeaseKind


class StoreCore(StoreState):
    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace and the size of its chunks; returns its id (the root key).
        Re-registering a known namespace always works; past ``max_namespaces`` a new one
        first retires the least recently used namespace that is empty and idle (see the
        module's docstring), and is refused (LIMIT_EXCEEDED) if none is: each costs the store
        memory and a tenant entry."""
        if chunk_bytes <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "chunk_bytes must be positive")
        ns_id = namespace.root_key()
        with self._lock:
            known = self._namespaces.get(ns_id)
            if known is not None and known.chunk_bytes != chunk_bytes:
                raise KvtierError(
                    ErrorCode.NAMESPACE_MISMATCH,
                    f"namespace {ns_id.hex()} is registered with {known.chunk_bytes}-byte "
                    f"chunks, not {chunk_bytes}",
                )
            if chunk_bytes > self.capacity_bytes:
                raise KvtierError(
                    ErrorCode.WRONG_SIZE,
                    f"a {chunk_bytes}-byte chunk cannot fit a {self.capacity_bytes}-byte pool",
                )
            now = self._clock()
            if known is None and len(self._namespaces) >= self.limits.max_namespaces:
                self._reap(now)  # expired write leases hold chunks of no namespace any more
                need = len(self._namespaces) - self.limits.max_namespaces + 1
                if self._retire_idle_namespaces(now, need) < need:
                    raise KvtierError(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"{len(self._namespaces)} namespaces registered, none both empty and "
                        f"unused for {self.limits.namespace_idle_s} s: store.max_namespaces = "
                        f"{self.limits.max_namespaces}",
                    )
            if known is None:
                tenant = self._tenants.tenant(namespace.cache_salt)
                tenant.namespaces += 1
                self._namespaces[ns_id] = NamespaceInfo(ns_id, chunk_bytes, namespace, tenant)
            self._use_namespace(ns_id, now)
        return ns_id

    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        """What ``ns_id`` was registered with (UNKNOWN_NAMESPACE: never, or retired). A read
        only: not counted as a use."""
        return self._registered(ns_id)

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        """Longest committed prefix of ``keys``; with ``lease_ttl_s``, pinned under a lease
        (that also ends with ``session``, when one is given: UNKNOWN_SESSION if it is not
        open)."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._lock:
            now = self._clock()
            self._use_namespace(ns_id, now)
            self._reap(now)
            if lease_ttl_s is not None:
                self._check_session(session)
            hits: list[ChunkEntry] = []
            stop = LookupStatus.HIT
            for key in keys:
                entry = self._table.get(key)
                if not self._held_by(entry, ns_id):  # absent, or another namespace's
                    stop = LookupStatus.MISS
                    break
                if entry.state is not ChunkState.COMMITTED:
                    stop = LookupStatus.PENDING
                    break
                hits.append(entry)
            lease_id, granted = 0, 0.0
            if lease_ttl_s is not None and hits:
                ttl = self._ttl(lease_ttl_s)
                self._check_lease_room(session, len(hits))  # before anything changes
            for entry in hits:
                entry.last_access = now
                self._book.policy.touch(entry.key)
            if lease_ttl_s is not None and hits:
                for entry in hits:
                    self._book.pin(entry)
                lease_id = self._new_lease(LeaseKind.READ, hits, now, ttl, session)
                granted = min(ttl, self.limits.max_lease_lifetime_s)
            self.counters["lookups"] += 1
            self.counters["hit_chunks"] += len(hits)
            self.counters["miss_chunks"] += len(keys) - len(hits)
            self.counters["pending_lookups"] += stop is LookupStatus.PENDING
            locations = [self._book.location(e) for e in hits]
            return LookupResult(locations, stop, lease_id, self.epoch, granted)

    def committed_mask(self, ns_id: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed here now. No side effects on chunks (no lease, no use counted);
        the namespace counts as used."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._lock:
            self._use_namespace(ns_id, self._clock())
            out = []
            for key in keys:
                entry = self._table.get(key)
                out.append(self._held_by(entry, ns_id) and entry.state is ChunkState.COMMITTED)
            return out

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End leases. A read lease released OK guarantees its chunks never changed meanwhile;
        EXPIRED means they may have (also when its session ended): the holder must discard
        what it copied."""
        self.limits.check_batch(len(lease_ids), "lease ids")
        out = []
        with self._lock:
            self._reap(self._clock())
            for lease_id in lease_ids:
                lease = self._leases.pop(lease_id)
                if lease is None:
                    expired = self._leases.was_expired(lease_id)
                    out.append(LeaseStatus.EXPIRED if expired else LeaseStatus.UNKNOWN)
                    continue
                self._end_lease(lease, "released")
                out.append(LeaseStatus.OK)
        return out

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Extend a lease; returns seconds until its new expiry: the TTL asked for, shortened
        to what is left of the lease's lifetime (``max_lease_lifetime_s`` from its creation).
        Past that the lease is gone: LEASE_EXPIRED."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            lease = self._get_lease(lease_id)
            ttl = self._ttl(ttl_s if ttl_s is not None else self._default_ttl(lease.kind))
            self._leases.renew(lease, now + ttl)
            return lease.expires - now

    # -- sessions ----------------------------------------------------------------------------

    def open_session(self) -> int:
        """A new client session (LIMIT_EXCEEDED past ``max_sessions``); heartbeat it within
        ``session_timeout_s``, or it ends with every lease created under it."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            session = self._sessions.open(now)
            self.counters["sessions_opened"] += 1
            return session

    def heartbeat(self, session: int) -> bool:
        """Keep ``session`` alive. False if it is not open (closed or timed out: its leases
        are gone, and the client must open a new session)."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            return self._sessions.touch(session, now)

    def close_session(self, session: int) -> int:
        """End ``session`` and its leases (read leases unpinned, write leases aborted).
        Returns how many leases that ended; 0 for a session not open."""
        with self._lock:
            self._reap(self._clock())
            if not self._sessions.close(session):
                return 0
            self.counters["sessions_closed"] += 1
            return self._end_session(session)

    # -- writes ------------------------------------------------------------------------------

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> AllocateResult:
        """Reserve pages for chunks about to be written, evicting as needed. The write lease
        also ends with ``session`` (UNKNOWN_SESSION if it is not open). A batch asking for
        more than ``max_batch_fraction`` of the pool that does not fit in free space is
        refused whole (LIMIT_EXCEEDED), before anything is evicted. A tenant at its quota
        evicts its own coldest chunks first; a chunk it still cannot fit is NO_SPACE. Past the
        session's lease bounds (``StoreLimits``) it is refused whole (LIMIT_EXCEEDED)."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        if len(sizes) != len(keys):
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(sizes)} sizes"
            )
        if len(set(keys)) != len(keys):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "duplicate keys in one allocation")
        with self._lock:
            now = self._clock()
            info = self._use_namespace(ns_id, now)
            for key, size in zip(keys, sizes, strict=True):
                if size != info.chunk_bytes:
                    raise KvtierError(
                        ErrorCode.WRONG_SIZE,
                        f"chunk {key.hex()} is {size} bytes; namespace {ns_id.hex()} "
                        f"stores {info.chunk_bytes}-byte chunks",
                    )
            self._reap(now)  # first: chunks of expired write leases are fresh again
            fresh = sum(1 for key in keys if not self._held_by(self._table.get(key), ns_id))
            self._check_session(session)
            ttl = self._ttl(ttl_s if ttl_s is not None else self.write_ttl_s)
            self._check_lease_room(session, fresh)
            pages_each = -(-info.chunk_bytes // self.page_size)
            self.limits.check_share(
                fresh * pages_each, self._alloc.free_pages, self._alloc.num_pages, self.page_size
            )
            tenant = info.tenant
            statuses: list[AllocStatus] = []
            locations: list[ChunkLocation | None] = []
            written: list[ChunkEntry] = []
            evicted: list[ChunkEntry] = []
            self._book.quota_room(tenant, fresh * pages_each, pages_each, keys, evicted)
            for key, size in zip(keys, sizes, strict=True):
                entry = self._table.get(key)
                if entry is not None and entry.namespace != ns_id:
                    # Another namespace's chunk: neither taken over nor confirmed. It answers
                    # as an absent key that found no room (docs/security.md, the residual).
                    statuses.append(AllocStatus.NO_SPACE)
                    locations.append(None)
                    continue
                if entry is not None:
                    if entry.state is ChunkState.COMMITTED:
                        # The writer wants it kept: count it as a use, so that making room for
                        # the rest of this batch does not evict the prefix it extends.
                        self._book.policy.touch(key)
                        status = AllocStatus.EXISTS
                    else:
                        status = AllocStatus.IN_PROGRESS
                    statuses.append(status)
                    locations.append(None)
                    continue
                pages = -(-size // self.page_size)
                room = tenant.room()
                runs = None
                if room is not None and room < pages:
                    self.counters["quota_no_space"] += 1
                else:
                    runs = self._book.allocate(pages, evicted, tenant)
                if runs is None:
                    statuses.append(AllocStatus.NO_SPACE)
                    locations.append(None)
                    continue
                entry = ChunkEntry(key, ns_id, size, runs, pages, ChunkState.WRITING, tenant)
                entry.last_access = now
                self._book.add_writing(entry)
                written.append(entry)
                statuses.append(AllocStatus.ALLOCATED)
                locations.append(self._book.location(entry))
            for status in statuses:
                self.counters[status.value] += 1
            self._emit_removed(evicted)
            lease_id = (
                self._new_lease(LeaseKind.WRITE, written, now, ttl, session) if written else 0
            )
            granted = min(ttl, self.limits.max_lease_lifetime_s) if lease_id else 0.0
            return AllocateResult(lease_id, statuses, locations, self.epoch, granted)

    def commit(self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]) -> int:
        """Make written chunks readable. ``keys=None`` commits the whole lease.

        Returns how many chunks became readable (a chunk deleted while being written is
        dropped instead). The lease ends once nothing in it is left uncommitted.
        """
        if keys is not None:
            self.limits.check_batch(len(keys))
        with self._lock:
            self._reap(self._clock())
            lease = self._get_lease(lease_id, LeaseKind.WRITE)
            entries = self._select(lease.entries, keys)
            if len(checksums) != len(entries):
                raise KvtierError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"{len(entries)} chunks to commit but {len(checksums)} checksums",
                )
            stored: dict[bytes, list[bytes]] = {}
            committed = 0
            chosen = set(map(id, entries))
            lease.entries = [e for e in lease.entries if id(e) not in chosen]
            for entry, checksum in zip(entries, checksums, strict=True):
                if not self._book.commit(entry, checksum):
                    continue  # deleted while being written: freed
                if not checksum:
                    self._unsummed.append(entry)
                stored.setdefault(entry.namespace, []).append(entry.key)
                committed += 1
            if not lease.entries:
                self._leases.pop(lease_id)
            self.counters["commits"] += committed
            self.events.append(
                [StoreEvent(EventKind.STORED, ns, tuple(ks)) for ns, ks in stored.items()]
            )
            return committed

    def abort(
        self,
        lease_id: int,
        keys: Sequence[bytes] | None = None,
        quarantine_s: float | None = None,
    ) -> int:
        """Give back chunks allocated but not to be written. Returns how many.

        ``quarantine_s``: the pages may still be written by someone else (a failed remote
        transfer): the chunks leave the table now, their pages are reused only after that long.
        """
        if quarantine_s is not None and not quarantine_s >= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad quarantine {quarantine_s}")
        if keys is not None:
            self.limits.check_batch(len(keys))
        with self._lock:
            now = self._clock()
            self._reap(now)
            lease = self._get_lease(lease_id, LeaseKind.WRITE)
            entries = self._select(lease.entries, keys)
            chosen = set(map(id, entries))
            lease.entries = [e for e in lease.entries if id(e) not in chosen]
            if quarantine_s:
                self._book.drop_writing(entries, quarantine_until=now + quarantine_s)
            else:
                self._book.drop_writing(entries)
            if not lease.entries:
                self._leases.pop(lease_id)
            self.counters["aborts"] += len(entries)
            return len(entries)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """Remove chunks (idempotent: unknown keys, and keys held under another namespace,
        are skipped). Returns how many were held."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._lock:
            self._use_namespace(ns_id, self._clock())
            removed: list[ChunkEntry] = []
            for key in keys:
                entry = self._table.get(key)
                if not self._held_by(entry, ns_id):  # absent, or another namespace's
                    continue
                if entry.state is ChunkState.COMMITTED:
                    self._book.policy.remove(key)
                    removed.append(entry)
                self._book.unlink(entry)
            self._emit_removed(removed)
            self.counters["deletes"] += len(removed)
            return len(removed)

    def clear(self) -> int:
        """Remove every chunk. Pinned and half-written ones go once their leases end."""
        with self._lock:
            entries = list(self._table.values())
            for entry in entries:
                if entry.state is ChunkState.COMMITTED:
                    self._book.policy.remove(entry.key)
                self._book.unlink(entry)
            self.counters["clears"] += 1
            self.events.append([StoreEvent(EventKind.CLEARED)])
            return len(entries)

    # -- checksums ---------------------------------------------------------------------------
    # Writers may commit without a checksum (0) so a put costs one memcpy; the store computes
    # it afterwards, off the writer's path, pinning the chunk meanwhile so it cannot change.

    def take_unsummed(self, limit: int = 64) -> list[tuple[ChunkEntry, ChunkLocation]]:
        """Pin up to ``limit`` committed chunks that still lack a checksum."""
        out: list[tuple[ChunkEntry, ChunkLocation]] = []
        with self._lock:
            while self._unsummed and len(out) < limit:
                entry = self._unsummed.popleft()
                if entry.doomed or entry.checksum:
                    continue
                self._book.pin(entry)
                out.append((entry, self._book.location(entry)))
        return out

    def unsummed_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._unsummed if not e.doomed and not e.checksum)

    def finish_checksums(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for ``take_unsummed``'s chunks and unpin them."""
        with self._lock:
            for entry, checksum in done:
                entry.checksum = checksum
                self._book.unpin(entry)

    def read_lease_entries(self, lease_id: int) -> list[ChunkEntry]:
        """The chunks pinned by a read lease, in lookup order (to checksum them in place)."""
        with self._lock:
            return list(self._get_lease(lease_id, LeaseKind.READ).entries)

    def record_checksums(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for pinned chunks (e.g. of a read lease)."""
        with self._lock:
            for entry, checksum in done:
                if not entry.checksum:
                    entry.checksum = checksum

    def location_of(self, entry: ChunkEntry) -> ChunkLocation:
        with self._lock:
            return self._book.location(entry)

    # -- demotion ----------------------------------------------------------------------------

    def coldest(self, max_bytes: int) -> list[tuple[bytes, bytes, int]]:
        """Up to ``max_bytes`` of unpinned committed chunks, coldest first, as (namespace id,
        key, size): what eviction would take next. Nothing is changed."""
        out: list[tuple[bytes, bytes, int]] = []
        with self._lock:
            total = 0
            for key in self._book.policy.coldest(self._book.evictable):
                entry = self._table[cast(bytes, key)]
                if total + entry.pages * self.page_size > max_bytes:
                    break
                total += entry.pages * self.page_size
                out.append((entry.namespace, entry.key, entry.size))
        return out

    # -- housekeeping ------------------------------------------------------------------------

    def reap(self) -> None:
        """Expire leases and sessions, and retire idle empty namespaces, now (the service
        also calls this from a timer)."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            self._retire_idle_namespaces(now)

    def snapshot(self) -> Snapshot:
        with self._lock:
            chunks: dict[bytes, list[bytes]] = {}
            for entry in self._table.values():
                if entry.state is ChunkState.COMMITTED:
                    chunks.setdefault(entry.namespace, []).append(entry.key)
            return Snapshot(self.events.last_seq, chunks)
