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
- A key held under another namespace answers as absent (``PageBook.held`` says why): a lookup
  misses there, a delete skips it, an allocate answers NO_SPACE for it.
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
- Namespaces are bounded (``max_namespaces``) but not forever: one that holds no chunk and
  that nobody used for ``namespace_idle_s`` is retired (``kvtier.store.state.namespaces``). A
  cache reset (``on_reset: bump``) starts a new generation of an instance's namespaces; the
  old generation goes this way once its chunks are evicted.

``StoreCore`` is composed of the components that hold its state, each with its own rules, and
every operation reads as calls on them: ``pages`` (``PageBook``: the chunk table, the page
allocator, eviction, page counts), ``tenants`` (quotas and floors), ``namespaces``, ``leases``
(``LeaseTable``: TTLs, lifetimes, what ending one undoes), ``sessions``, ``checksums`` (chunks
committed without one), ``events`` (the event log), ``limits`` (per-request bounds) and the
``counters``. What the store's own workers do to chunks outside any request (checksums,
demotion) is ``upkeep`` (``kvtier.store.state.upkeep``), and how leases and sessions end
(released, renewed, with their session, by time) is ``lifetimes``
(``kvtier.store.state.lifetimes``): both on the same components under the same lock. What the
store says about itself (``stats``, ``snapshot``) and what must always hold across the
components (``check_invariants``) are mixed in from ``kvtier.store.state.report``.

Threading: every public method takes the store's lock; call from any thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvtier.core.chunks import LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, check_keys
from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.api.types import AllocateResult, LeaseStatus, LookupResult
from kvtier.store.state.checksums import ChecksumQueue
from kvtier.store.state.entries import COUNTERS, ChunkEntry, ChunkState, NamespaceInfo
from kvtier.store.state.eventlog import EventLog
from kvtier.store.state.leases import LeaseKind, LeaseTable
from kvtier.store.state.lifetimes import Lifetimes
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.namespaces import NamespaceTable
from kvtier.store.state.pages import PageBook
from kvtier.store.state.quotas import TenantBook
from kvtier.store.state.report import StoreReporting
from kvtier.store.state.sessions import SessionTable
from kvtier.store.state.upkeep import PoolUpkeep
from kvtier.store.state.view_pins import ViewPins


class StoreCore(StoreReporting):
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
        self._clock = clock
        self._lock = threading.RLock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.limits = limits = limits or StoreLimits()
        self.tenants = TenantBook(page_size, num_pages, limits.tenants, limits.default_quota_bytes)
        self.pages = PageBook(
            num_pages, page_size, eviction, self.counters, self.tenants, clock=clock
        )
        self.namespaces = NamespaceTable(limits, self.pages, self.tenants, self.counters)
        self.leases = LeaseTable(
            self.pages,
            limits,
            self.counters,
            clock,
            read_ttl_s=lease_ttl_s,
            write_ttl_s=write_ttl_s,
            max_ttl_s=max_lease_ttl_s,
        )
        self.sessions = SessionTable(limits.session_timeout_s, limits.max_sessions)
        self.checksums = ChecksumQueue(self.pages)
        self.events = EventLog(node_id=node_id, epoch=epoch, capacity=event_buffer)
        self.upkeep = PoolUpkeep(self._lock, self.pages, self.checksums, self.leases)
        self.lifetimes = Lifetimes(
            self._lock, clock, self.pages, self.leases, self.sessions, limits, self.counters
        )

    def attach_view_pins(self, pins: ViewPins) -> None:
        """Honour the engines' own read leases from now on (``kvtier.store.state.view_pins``):
        before any session opens or chunk commits."""
        with self._lock:
            self.pages.view_pins = pins

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The store's lock and, with engines' own leases, the pin table's: around anything
        that may free a committed chunk's pages. The hits engines made themselves are counted
        first (uses, in the eviction order)."""
        with self._lock:
            pins = self.pages.view_pins
            if pins is None:
                yield
                return
            pins.begin()
            try:
                self._count_view_hits(pins.take_touches())
                yield
            finally:
                pins.end()

    def _count_view_hits(self, serials: list[int]) -> None:
        if not serials:
            return
        now = self._clock()
        for serial in serials:
            entry = self.pages.by_serial.get(serial)
            if entry is not None:
                entry.last_access = now
                self.pages.policy.touch(entry.key)
        self.counters["view_hit_chunks"] += len(serials)

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace and the size of its chunks; returns its id (the root key).
        Re-registering a known namespace always works; past ``max_namespaces`` a new one
        first retires the least recently used namespace that is empty and idle, and is
        refused (LIMIT_EXCEEDED) if none is: each costs the store memory and a tenant entry."""
        if chunk_bytes <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "chunk_bytes must be positive")
        ns_id = namespace.root_key()
        with self._lock:
            known = self.namespaces.known(ns_id, chunk_bytes)
            if chunk_bytes > self.capacity_bytes:
                raise KvtierError(
                    ErrorCode.WRONG_SIZE,
                    f"a {chunk_bytes}-byte chunk cannot fit a {self.capacity_bytes}-byte pool",
                )
            now = self._clock()
            if known is None:
                if self.namespaces.full:
                    # expired write leases hold chunks of no namespace any more
                    self.lifetimes.expire(now)
                    self.namespaces.make_room(now)
                self.namespaces.add(namespace, chunk_bytes)
            self.namespaces.use(ns_id, now)
        return ns_id

    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        """What ``ns_id`` was registered with (UNKNOWN_NAMESPACE: never, or retired). A read
        only: not counted as a use."""
        return self.namespaces.get(ns_id)

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
            self.namespaces.use(ns_id, now)
            self.lifetimes.expire(now)
            if lease_ttl_s is not None:
                self.sessions.check(session)
            hits: list[ChunkEntry] = []
            stop = LookupStatus.HIT
            for key in keys:
                entry = self.pages.held(key, ns_id)
                if entry is None:  # absent, or another namespace's
                    stop = LookupStatus.MISS
                    break
                if entry.state is not ChunkState.COMMITTED:
                    stop = LookupStatus.PENDING
                    break
                hits.append(entry)
            lease_id, granted = 0, 0.0
            if lease_ttl_s is not None and hits:
                ttl = self.leases.ttl(lease_ttl_s)
                self.leases.check_room(session, len(hits))  # before anything changes
            for entry in hits:
                entry.last_access = now
                self.pages.policy.touch(entry.key)
            if lease_ttl_s is not None and hits:
                for entry in hits:
                    self.pages.pin(entry)
                lease_id = self.leases.grant(LeaseKind.READ, hits, now, ttl, session).id
                granted = self.leases.granted(ttl)
            self.counters["lookups"] += 1
            self.counters["hit_chunks"] += len(hits)
            self.counters["miss_chunks"] += len(keys) - len(hits)
            self.counters["pending_lookups"] += stop is LookupStatus.PENDING
            locations = [self.pages.location(e) for e in hits]
            return LookupResult(locations, stop, lease_id, self.epoch, granted)

    def committed_mask(self, ns_id: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed here now. No side effects on chunks (no lease, no use counted);
        the namespace counts as used."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._lock:
            self.namespaces.use(ns_id, self._clock())
            out = []
            for key in keys:
                entry = self.pages.held(key, ns_id)
                out.append(entry is not None and entry.state is ChunkState.COMMITTED)
            return out

    def pin_committed(
        self, ns_id: bytes, keys: Sequence[bytes]
    ) -> tuple[list[bool], list[ChunkEntry]]:
        """``committed_mask``, with every committed chunk among ``keys`` pinned (not counted
        as a use) until ``upkeep.unpin``: a stage that allocates the missing chunks of a run cannot
        then evict the run's own chunks already here, the coldest ones and, with the disk
        tier, clean ones (``prefer_evicting``): eviction's first choice."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._lock:
            self.namespaces.use(ns_id, self._clock())
            mask: list[bool] = []
            pinned: list[ChunkEntry] = []
            for key in keys:
                entry = self.pages.held(key, ns_id)
                if entry is None or entry.state is not ChunkState.COMMITTED:
                    mask.append(False)
                    continue
                self.pages.pin(entry)
                pinned.append(entry)
                mask.append(True)
            return mask, pinned

    # -- leases and sessions: how they end (``lifetimes``) -----------------------------------

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        return self.lifetimes.release(lease_ids)

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        return self.lifetimes.renew(lease_id, ttl_s)

    def open_session(self) -> int:
        return self.lifetimes.open_session()

    def grant_pin_row(self, session: int) -> None:
        self.lifetimes.grant_pin_row(session)

    def heartbeat(self, session: int) -> bool:
        return self.lifetimes.heartbeat(session)

    def close_session(self, session: int) -> int:
        return self.lifetimes.close_session(session)

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
        with self._exclusive():
            now = self._clock()
            info = self.namespaces.use(ns_id, now)
            for key, size in zip(keys, sizes, strict=True):
                if size != info.chunk_bytes:
                    raise KvtierError(
                        ErrorCode.WRONG_SIZE,
                        f"chunk {key.hex()} is {size} bytes; namespace {ns_id.hex()} "
                        f"stores {info.chunk_bytes}-byte chunks",
                    )
            self.lifetimes.expire(now)  # first: chunks of expired write leases are fresh again
            fresh = sum(1 for key in keys if self.pages.held(key, ns_id) is None)
            self.sessions.check(session)
            ttl = self.leases.ttl(ttl_s if ttl_s is not None else self.write_ttl_s)
            self.leases.check_room(session, fresh)
            pages_each = -(-info.chunk_bytes // self.page_size)
            alloc = self.pages.alloc
            self.limits.check_share(
                fresh * pages_each, alloc.free_pages, alloc.num_pages, self.page_size
            )
            evicted: list[ChunkEntry] = []
            self.pages.quota_room(info.tenant, fresh * pages_each, pages_each, keys, evicted)
            statuses, locations, written = self.pages.place(
                ns_id, keys, sizes, info.tenant, now, evicted
            )
            for status in statuses:
                self.counters[status.value] += 1
            self.events.removed(evicted)
            lease_id = 0
            if written:
                lease_id = self.leases.grant(LeaseKind.WRITE, written, now, ttl, session).id
            granted = self.leases.granted(ttl) if lease_id else 0.0
            return AllocateResult(lease_id, statuses, locations, self.epoch, granted)

    def commit(
        self,
        lease_id: int,
        keys: Sequence[bytes] | None,
        checksums: Sequence[int],
        *,
        as_ns_id: bytes = b"",
        as_keys: Sequence[bytes] | None = None,
    ) -> int:
        """Make written chunks readable. ``keys=None`` commits the whole lease.

        ``as_keys``: the chunks ``keys`` name are placeholders (pool space an engine took
        ahead, kvtier.connector.save_slab) and commit as ``as_keys`` of namespace ``as_ns_id``,
        which must be the same tenant's with the same chunk size (PERMISSION_DENIED,
        WRONG_SIZE). A name already stored or being stored keeps what it has: that
        placeholder's pages are freed and it does not count.

        Returns how many chunks became readable (a chunk deleted while being written is
        dropped instead). The lease ends once nothing in it is left uncommitted.
        """
        if keys is not None:
            self.limits.check_batch(len(keys))
        if as_keys is not None:
            check_keys(as_keys)
            if keys is None or len(as_keys) != len(keys) or len(set(as_keys)) != len(as_keys):
                raise KvtierError(
                    ErrorCode.INVALID_ARGUMENT,
                    "as_keys names each key of the commit once, in order",
                )
        with self._lock:
            self.lifetimes.expire(self._clock())
            lease = self.leases.require(lease_id, LeaseKind.WRITE)
            entries = lease.select(keys)
            if len(checksums) != len(entries):
                raise KvtierError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"{len(entries)} chunks to commit but {len(checksums)} checksums",
                )
            if as_keys is not None:
                self.namespaces.check_rename(as_ns_id, entries, self._clock())
            stored: dict[bytes, list[bytes]] = {}
            committed = 0
            lease.drop(entries)
            for i, (entry, checksum) in enumerate(zip(entries, checksums, strict=True)):
                # (a doomed placeholder is not renamed: the commit frees it)
                name = as_keys[i] if as_keys is not None and not entry.doomed else None
                if name is not None and not self.pages.rekey(entry, as_ns_id, name):
                    self.pages.drop_writing([entry])  # stored by someone else meanwhile
                    self.counters["exists"] += 1
                    continue
                if not self.pages.commit(entry, checksum):
                    continue  # deleted while being written: freed
                if not checksum:
                    self.checksums.add(entry)
                stored.setdefault(entry.namespace, []).append(entry.key)
                committed += 1
            if not lease.entries:
                self.leases.pop(lease_id)
            self.counters["commits"] += committed
            self.events.stored(stored)
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
            self.lifetimes.expire(now)
            lease = self.leases.require(lease_id, LeaseKind.WRITE)
            entries = lease.select(keys)
            lease.drop(entries)
            if quarantine_s:
                self.pages.drop_writing(entries, quarantine_until=now + quarantine_s)
            else:
                self.pages.drop_writing(entries)
            if not lease.entries:
                self.leases.pop(lease_id)
            self.counters["aborts"] += len(entries)
            return len(entries)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """Remove chunks (idempotent: unknown keys, and keys held under another namespace,
        are skipped). Returns how many were held."""
        self.limits.check_batch(len(keys))
        check_keys(keys)
        with self._exclusive():
            self.namespaces.use(ns_id, self._clock())
            removed: list[ChunkEntry] = []
            for key in keys:
                entry = self.pages.held(key, ns_id)
                if entry is None:  # absent, or another namespace's
                    continue
                if entry.state is ChunkState.COMMITTED:
                    self.pages.policy.remove(key)
                    removed.append(entry)
                self.pages.unlink(entry)
            self.events.removed(removed)
            self.counters["deletes"] += len(removed)
            return len(removed)

    def clear(self) -> int:
        """Remove every chunk. Pinned and half-written ones go once their leases end."""
        with self._exclusive():
            entries = list(self.pages.table.values())
            for entry in entries:
                if entry.state is ChunkState.COMMITTED:
                    self.pages.policy.remove(entry.key)
                self.pages.unlink(entry)
            self.counters["clears"] += 1
            self.events.append([StoreEvent(EventKind.CLEARED)])
            return len(entries)

    # -- housekeeping ------------------------------------------------------------------------

    def reap(self) -> None:
        """Expire leases and sessions, and retire idle empty namespaces, now (the service
        also calls this from a timer)."""
        with self._exclusive():
            now = self._clock()
            self.lifetimes.expire(now)
            self.namespaces.retire_idle(now)
            if self.pages.view_pins is not None:
                self.pages.view_pins.expire(self.limits.max_lease_lifetime_s)
