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
- Every lease expires, so a client that dies leaks nothing.
- Pages a failed remote transfer was writing are quarantined (``abort(..., quarantine_s=)``):
  out of the table at once, but not handed out again until the quarantine ends, because the
  transfer engine may still deliver late bytes into them.

Threading: every public method takes the store's lock; call from any thread.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace
from kvtier.store.events import EventKind, EventLog, StoreEvent
from kvtier.store.leases import LeaseKind, LeaseStatus, LeaseTable
from kvtier.store.types import (
    COUNTERS,
    AllocateResult,
    AllocStatus,
    ChunkEntry,
    ChunkState,
    LookupResult,
    NamespaceInfo,
    Snapshot,
    check_keys,
)
from kvtier.tiers.base import ChunkLocation, LookupStatus
from kvtier.tiers.cpu.allocator import PageAllocator, PageRun
from kvtier.tiers.cpu.eviction import make_policy


class StoreCore:
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
    ) -> None:
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
        self._alloc = PageAllocator(num_pages)
        self._policy = make_policy(eviction, num_pages)
        self._table: dict[bytes, ChunkEntry] = {}
        self._namespaces: dict[bytes, NamespaceInfo] = {}
        self._leases = LeaseTable()
        self._unsummed: deque[ChunkEntry] = deque()  # committed without a checksum
        self._pages = {"committed": 0, "pinned": 0, "writing": 0, "doomed": 0, "quarantined": 0}
        # (release time, tie-breaker, runs): pages held back from reuse until release time.
        self._quarantine: list[tuple[float, int, list[PageRun]]] = []
        self._quarantine_seq = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- namespaces --------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        """Declare a namespace and the size of its chunks; returns its id (the root key)."""
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
            self._namespaces[ns_id] = NamespaceInfo(ns_id, chunk_bytes, namespace)
        return ns_id

    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        info = self._namespaces.get(ns_id)
        if info is None:
            raise KvtierError(
                ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} is not registered"
            )
        return info

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> LookupResult:
        """Longest committed prefix of ``keys``; with ``lease_ttl_s``, pinned under a lease."""
        check_keys(keys)
        with self._lock:
            self.namespace(ns_id)
            now = self._clock()
            self._reap(now)
            hits: list[ChunkEntry] = []
            stop = LookupStatus.HIT
            for key in keys:
                entry = self._table.get(key)
                if entry is None:
                    stop = LookupStatus.MISS
                    break
                self._check_owner(entry, ns_id)
                if entry.state is not ChunkState.COMMITTED:
                    stop = LookupStatus.PENDING
                    break
                hits.append(entry)
            for entry in hits:
                entry.last_access = now
                self._policy.touch(entry.key)
            lease_id = 0
            if lease_ttl_s is not None and hits:
                ttl = self._ttl(lease_ttl_s)
                for entry in hits:
                    self._pin(entry)
                lease_id = self._leases.create(LeaseKind.READ, hits, now + ttl).id
            self.counters["lookups"] += 1
            self.counters["hit_chunks"] += len(hits)
            self.counters["miss_chunks"] += len(keys) - len(hits)
            self.counters["pending_lookups"] += stop is LookupStatus.PENDING
            return LookupResult([self._location(e) for e in hits], stop, lease_id, self.epoch)

    def committed_mask(self, ns_id: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed here now. No side effects (no lease, no use counted)."""
        check_keys(keys)
        with self._lock:
            self.namespace(ns_id)
            out = []
            for key in keys:
                entry = self._table.get(key)
                out.append(
                    entry is not None
                    and entry.namespace == ns_id
                    and entry.state is ChunkState.COMMITTED
                )
            return out

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End leases. A read lease released OK guarantees its chunks never changed meanwhile;
        EXPIRED means they may have: the holder must discard what it copied."""
        out = []
        with self._lock:
            self._reap(self._clock())
            for lease_id in lease_ids:
                lease = self._leases.pop(lease_id)
                if lease is None:
                    expired = self._leases.was_expired(lease_id)
                    out.append(LeaseStatus.EXPIRED if expired else LeaseStatus.UNKNOWN)
                    continue
                if lease.kind is LeaseKind.READ:
                    self.counters["released_read"] += 1
                    for entry in lease.entries:
                        self._unpin(entry)
                else:
                    self.counters["released_write"] += 1
                    self._drop_writing(lease.entries)
                out.append(LeaseStatus.OK)
        return out

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Extend a lease; returns seconds until its new expiry."""
        with self._lock:
            now = self._clock()
            self._reap(now)
            lease = self._get_lease(lease_id)
            ttl = self._ttl(ttl_s if ttl_s is not None else self._default_ttl(lease.kind))
            self._leases.renew(lease, now + ttl)
            return ttl

    # -- writes ------------------------------------------------------------------------------

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
    ) -> AllocateResult:
        """Reserve pages for chunks about to be written, evicting as needed."""
        check_keys(keys)
        if len(sizes) != len(keys):
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(sizes)} sizes"
            )
        if len(set(keys)) != len(keys):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "duplicate keys in one allocation")
        with self._lock:
            info = self.namespace(ns_id)
            for key, size in zip(keys, sizes, strict=True):
                if size != info.chunk_bytes:
                    raise KvtierError(
                        ErrorCode.WRONG_SIZE,
                        f"chunk {key.hex()} is {size} bytes; namespace {ns_id.hex()} "
                        f"stores {info.chunk_bytes}-byte chunks",
                    )
            for key in keys:
                entry = self._table.get(key)
                if entry is not None:
                    self._check_owner(entry, ns_id)
            now = self._clock()
            self._reap(now)
            ttl = self._ttl(ttl_s if ttl_s is not None else self.write_ttl_s)
            statuses: list[AllocStatus] = []
            locations: list[ChunkLocation | None] = []
            written: list[ChunkEntry] = []
            evicted: list[ChunkEntry] = []
            for key, size in zip(keys, sizes, strict=True):
                entry = self._table.get(key)
                if entry is not None:
                    if entry.state is ChunkState.COMMITTED:
                        # The writer wants it kept: count it as a use, so that making room for
                        # the rest of this batch does not evict the prefix it extends.
                        self._policy.touch(key)
                        status = AllocStatus.EXISTS
                    else:
                        status = AllocStatus.IN_PROGRESS
                    statuses.append(status)
                    locations.append(None)
                    continue
                pages = -(-size // self.page_size)
                runs = self._allocate_pages(pages, evicted)
                if runs is None:
                    statuses.append(AllocStatus.NO_SPACE)
                    locations.append(None)
                    continue
                entry = ChunkEntry(key, ns_id, size, runs, pages, ChunkState.WRITING)
                entry.last_access = now
                self._table[key] = entry
                self._pages["writing"] += pages
                written.append(entry)
                statuses.append(AllocStatus.ALLOCATED)
                locations.append(self._location(entry))
            for status in statuses:
                self.counters[status.value] += 1
            self._emit_removed(evicted)
            lease_id = self._leases.create(LeaseKind.WRITE, written, now + ttl).id if written else 0
            return AllocateResult(lease_id, statuses, locations, self.epoch)

    def commit(self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]) -> int:
        """Make written chunks readable. ``keys=None`` commits the whole lease.

        Returns how many chunks became readable (a chunk deleted while being written is
        dropped instead). The lease ends once nothing in it is left uncommitted.
        """
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
                self._pages["writing"] -= entry.pages
                if entry.doomed:
                    self._free(entry)
                    continue
                entry.state = ChunkState.COMMITTED
                entry.checksum = checksum
                if not checksum:
                    self._unsummed.append(entry)
                self._pages["committed"] += entry.pages
                self._policy.insert(entry.key, entry.pages)
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
        with self._lock:
            now = self._clock()
            self._reap(now)
            lease = self._get_lease(lease_id, LeaseKind.WRITE)
            entries = self._select(lease.entries, keys)
            chosen = set(map(id, entries))
            lease.entries = [e for e in lease.entries if id(e) not in chosen]
            if quarantine_s:
                self._drop_writing(entries, quarantine_until=now + quarantine_s)
            else:
                self._drop_writing(entries)
            if not lease.entries:
                self._leases.pop(lease_id)
            self.counters["aborts"] += len(entries)
            return len(entries)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        """Remove chunks (idempotent: unknown keys are skipped). Returns how many were held."""
        check_keys(keys)
        with self._lock:
            self.namespace(ns_id)
            removed: list[ChunkEntry] = []
            for key in keys:
                entry = self._table.get(key)
                if entry is None:
                    continue
                self._check_owner(entry, ns_id)
                if entry.state is ChunkState.COMMITTED:
                    self._policy.remove(key)
                    removed.append(entry)
                self._unlink(entry)
            self._emit_removed(removed)
            self.counters["deletes"] += len(removed)
            return len(removed)

    def clear(self) -> int:
        """Remove every chunk. Pinned and half-written ones go once their leases end."""
        with self._lock:
            entries = list(self._table.values())
            for entry in entries:
                if entry.state is ChunkState.COMMITTED:
                    self._policy.remove(entry.key)
                self._unlink(entry)
            self.counters["clears"] += 1
            self.events.append([StoreEvent(EventKind.CLEARED)])
            return len(entries)

    # -- checksums ---------------------------------------------------------------------------
    # Writers may commit without a checksum (0) so a put costs one memcpy; the store computes
    # it afterwards, off the writer's path, pinning the chunk meanwhile so it cannot change.

    def take_unsummed(self, limit: int = 64) -> list[tuple[ChunkEntry, ChunkLocation]]:
        """Pin up to ``limit`` committed chunks that still lack a checksum."""
        out = []
        with self._lock:
            while self._unsummed and len(out) < limit:
                entry = self._unsummed.popleft()
                if entry.doomed or entry.checksum:
                    continue
                self._pin(entry)
                out.append((entry, self._location(entry)))
        return out

    def unsummed_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._unsummed if not e.doomed and not e.checksum)

    def finish_checksums(self, done: list[tuple[ChunkEntry, int]]) -> None:
        """Record checksums computed for ``take_unsummed``'s chunks and unpin them."""
        with self._lock:
            for entry, checksum in done:
                entry.checksum = checksum
                self._unpin(entry)

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
            return self._location(entry)

    # -- demotion ----------------------------------------------------------------------------

    def coldest(self, max_bytes: int) -> list[tuple[bytes, bytes, int]]:
        """Up to ``max_bytes`` of unpinned committed chunks, coldest first, as (namespace id,
        key, size): what eviction would take next. Nothing is changed."""
        out: list[tuple[bytes, bytes, int]] = []
        with self._lock:
            total = 0
            for key in self._policy.coldest(self._evictable):
                entry = self._table[key]
                if total + entry.pages * self.page_size > max_bytes:
                    break
                total += entry.pages * self.page_size
                out.append((entry.namespace, key, entry.size))
        return out

    # -- housekeeping ------------------------------------------------------------------------

    def reap(self) -> None:
        """Expire leases now (the service also calls this from a timer)."""
        with self._lock:
            self._reap(self._clock())

    def snapshot(self) -> Snapshot:
        with self._lock:
            chunks: dict[bytes, list[bytes]] = {}
            for entry in self._table.values():
                if entry.state is ChunkState.COMMITTED:
                    chunks.setdefault(entry.namespace, []).append(entry.key)
            return Snapshot(self.events.last_seq, chunks)

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
                "eviction": self._policy.name,
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
                "event_seq": self.events.last_seq,
                **self.counters,
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
            assert len(committed) == len(self._policy)
            assert all(e.key in self._policy for e in committed)

    # -- internals ---------------------------------------------------------------------------

    def _allocate_pages(self, pages: int, evicted: list[ChunkEntry]) -> list[PageRun] | None:
        evictable = self._pages["committed"] - self._pages["pinned"]
        if self._alloc.free_pages + evictable < pages:
            return None  # evicting would not make room: keep what is there
        while self._alloc.free_pages < pages:
            key = self._policy.evict(self._evictable)
            if key is None:  # pragma: no cover - accounting above says something is evictable
                return None
            entry = self._table[key]
            self.counters["evictions"] += 1
            evicted.append(entry)
            self._unlink(entry)
        return self._alloc.allocate(pages)

    def _evictable(self, key: bytes) -> bool:
        return self._table[key].pins == 0

    def _pin(self, entry: ChunkEntry) -> None:
        if entry.pins == 0:
            self._pages["pinned"] += entry.pages
        entry.pins += 1

    def _unpin(self, entry: ChunkEntry) -> None:
        entry.pins -= 1
        if entry.pins:
            return
        if entry.doomed:
            self._pages["doomed"] -= entry.pages
            self._free(entry)
        else:
            self._pages["pinned"] -= entry.pages

    def _unlink(self, entry: ChunkEntry) -> None:
        """Take an entry out of the table; free its pages unless a lease still uses them."""
        del self._table[entry.key]
        entry.doomed = True
        if entry.state is ChunkState.WRITING:
            return  # its write lease frees it (commit, abort or expiry)
        self._pages["committed"] -= entry.pages
        if entry.pins:
            self._pages["pinned"] -= entry.pages
            self._pages["doomed"] += entry.pages
        else:
            self._free(entry)

    def _drop_writing(
        self, entries: list[ChunkEntry], quarantine_until: float | None = None
    ) -> None:
        for entry in entries:
            self._pages["writing"] -= entry.pages
            if not entry.doomed:
                del self._table[entry.key]
                entry.doomed = True
            if quarantine_until is None:
                self._free(entry)
            else:
                self._pages["quarantined"] += entry.pages
                self._quarantine_seq += 1
                heapq.heappush(
                    self._quarantine, (quarantine_until, self._quarantine_seq, entry.runs)
                )
                entry.runs = []
                self.counters["quarantined"] += 1

    def _free(self, entry: ChunkEntry) -> None:
        self._alloc.free(entry.runs)
        entry.runs = []

    def _reap(self, now: float) -> None:
        while self._quarantine and self._quarantine[0][0] <= now:
            _, _, runs = heapq.heappop(self._quarantine)
            self._pages["quarantined"] -= sum(n for _, n in runs)
            self._alloc.free(runs)
            self.counters["quarantine_released"] += 1
        for lease in self._leases.pop_expired(now):
            if lease.kind is LeaseKind.READ:
                self.counters["expired_read"] += 1
                for entry in lease.entries:
                    self._unpin(entry)
            else:
                self.counters["expired_write"] += 1
                self._drop_writing(lease.entries)

    def _emit_removed(self, entries: list[ChunkEntry]) -> None:
        by_ns: dict[bytes, list[bytes]] = {}
        for entry in entries:
            by_ns.setdefault(entry.namespace, []).append(entry.key)
        self.events.append(
            [StoreEvent(EventKind.REMOVED, ns, tuple(keys)) for ns, keys in by_ns.items()]
        )

    def _get_lease(self, lease_id: int, kind: LeaseKind | None = None):  # -> Lease
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

    def _check_owner(self, entry: ChunkEntry, ns_id: bytes) -> None:
        if entry.namespace != ns_id:
            raise KvtierError(
                ErrorCode.NAMESPACE_MISMATCH,
                f"chunk {entry.key.hex()} belongs to namespace {entry.namespace.hex()}, "
                f"not {ns_id.hex()}",
            )

    def _ttl(self, ttl_s: float) -> float:
        if not ttl_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"lease ttl must be > 0, got {ttl_s}")
        return min(ttl_s, self.max_lease_ttl_s)

    def _default_ttl(self, kind: LeaseKind) -> float:
        return self.lease_ttl_s if kind is LeaseKind.READ else self.write_ttl_s

    def _location(self, entry: ChunkEntry) -> ChunkLocation:
        extents = []
        remaining = entry.size
        for start, length in entry.runs:
            nbytes = min(length * self.page_size, remaining)
            extents.append((start * self.page_size, nbytes))
            remaining -= nbytes
        return ChunkLocation(entry.key, entry.size, tuple(extents), entry.checksum)
