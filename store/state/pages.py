"""Which pages hold which chunk: the pool's bookkeeping under the store's lock.

``PageBook`` owns the chunk table, the page allocator, the eviction policy and the page
counts by state, in total and per tenant (``kvtier.store.state.quotas``); ``StoreCore`` drives
it, and ends leases through it (``LeaseTable.end``). The counts always add up
(``check``): committed + writing + doomed (unlinked, still pinned) +
quarantined (a failed transfer may still write them) = pages in use. Per namespace it counts
the chunks not yet freed (``live``): in the table, or out of it but still pinned or being
written; the store retires only a namespace with none.

Eviction takes what the policy ranks coldest among chunks that are neither pinned nor being
written, and never a chunk whose tenant would drop below its floor for another tenant's
allocation. A tenant over its quota evicts its own coldest chunks first (``evict_own``).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import cast

from kvtier.core.chunks import ChunkLocation
from kvtier.store.api.types import AllocStatus
from kvtier.store.pool.allocator import PageAllocator, PageRun
from kvtier.store.pool.eviction import IsEvictable, make_policy
from kvtier.store.state.entries import ChunkEntry, ChunkState
from kvtier.store.state.quotas import Tenant, TenantBook
from kvtier.store.state.view_pins import HOLD_MIN_S, ViewPins

# how many of the coldest chunks eviction looks through for one the disk holds a copy of
CLEAN_SCAN = 64


class PageBook:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        eviction: str,
        counters: dict[str, int],
        tenants: TenantBook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages)
        self.policy = make_policy(eviction, num_pages)
        self.tenants = tenants or TenantBook(page_size, num_pages)
        self.table: dict[bytes, ChunkEntry] = {}
        # namespace id -> its chunks whose pages are not freed yet (absent: none)
        self.live: dict[bytes, int] = {}
        self.pages = {"committed": 0, "pinned": 0, "writing": 0, "doomed": 0, "quarantined": 0}
        # (release time, tie-breaker, runs): pages held back from reuse until release time.
        self.quarantine: list[tuple[float, int, list[PageRun]]] = []
        self.quarantine_seq = 0
        self.counters = counters  # the store's (evictions, quarantined, quarantine_released)
        self.now = clock
        # the disk tier's: has this chunk a copy on disk? (None: no disk tier). Eviction then
        # takes a copied chunk before a colder one that has none (``_clean_victim``).
        self.on_disk: Callable[[ChunkEntry], bool] | None = None
        # the engines' own read leases (kvtier.store.state.view_pins); None: only the store's
        self.view_pins: ViewPins | None = None
        self.by_serial: dict[int, ChunkEntry] = {}  # committed chunks by serial
        self._serials = itertools.count(1)
        self.view_held: list[ChunkEntry] = []  # unlinked, pages kept for an engine's pin

    def held(self, key: bytes, ns_id: bytes) -> ChunkEntry | None:
        """The chunk ``key`` as namespace ``ns_id`` sees it: None when absent or another
        namespace's. A chunk of another namespace answers as absent to that namespace's
        callers, never as an error: namespace ids are public (the index lists them), so anyone
        can compute another namespace's keys for a guessed prompt, and an answer that told
        "held elsewhere" from "absent" would say whether someone else holds that prompt
        (naming the owner would say whose)."""
        entry = self.table.get(key)
        return entry if entry is not None and entry.namespace == ns_id else None

    def release_quarantine(self, now: float) -> None:
        while self.quarantine and self.quarantine[0][0] <= now:
            _, _, runs = heapq.heappop(self.quarantine)
            self.pages["quarantined"] -= sum(n for _, n in runs)
            self.alloc.free(runs)
            self.counters["quarantine_released"] += 1

    def allocate(
        self, pages: int, evicted: list[ChunkEntry], tenant: Tenant
    ) -> list[PageRun] | None:
        """Pages for one chunk of ``tenant``, evicting as needed; None when evicting all it
        may evict would not make room (checked first, so then nothing is evicted)."""
        unpinned = self.pages["committed"] - self.pages["pinned"]
        if self.alloc.free_pages + self.tenants.evictable_for(tenant, unpinned) < pages:
            return None  # evicting would not make room: keep what is there
        evictable: IsEvictable = self.evictable
        if self.tenants.floored:
            evictable = self._evictable_for(tenant)
        while self.alloc.free_pages < pages:
            clean = self._clean_victim(evictable)
            if clean is not None:
                self.policy.remove(clean.key)
                self._evicted(clean, evicted)
                continue
            key = cast(bytes | None, self.policy.evict(evictable))
            if key is None:  # only when a floor is protected chunk by chunk (see evictable_for)
                return None
            if self.on_disk is not None:
                self.counters["dirty_evictions"] += 1
            self._evicted(self.table[key], evicted)
        return self.alloc.allocate(pages)

    def _clean_victim(self, evictable: IsEvictable) -> ChunkEntry | None:
        """With a disk tier: among the ``CLEAN_SCAN`` coldest evictable chunks, the coldest
        one the disk holds a copy of (evicting it loses nothing), else None (the policy's own
        victim goes, uncopied). Write-back runs behind a pool that turns over faster than it
        can copy: this keeps the chunks it has not reached yet."""
        if self.on_disk is None:
            return None
        for i, key in enumerate(self.policy.coldest(evictable)):
            if i >= CLEAN_SCAN:
                break
            entry = self.table[cast(bytes, key)]
            if self.on_disk(entry):
                return entry
        return None

    def place(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        tenant: Tenant,
        now: float,
        evicted: list[ChunkEntry],
    ) -> tuple[list[AllocStatus], list[ChunkLocation | None], list[ChunkEntry]]:
        """One allocation's chunks of namespace ``ns_id`` (``tenant``'s): per key its status,
        where to write it (ALLOCATED only) and the chunks now being written. A key of another
        namespace is neither taken over nor confirmed: it answers as an absent key that found
        no room (docs/security.md, the residual). A stored key counts as a use, so that
        making room for the rest of the batch does not evict the prefix it extends."""
        statuses: list[AllocStatus] = []
        locations: list[ChunkLocation | None] = []
        written: list[ChunkEntry] = []
        for key, size in zip(keys, sizes, strict=True):
            entry = self.table.get(key)
            if entry is not None:
                if entry.namespace != ns_id:
                    status = AllocStatus.NO_SPACE
                elif entry.state is ChunkState.COMMITTED:
                    self.policy.touch(key)  # the writer wants it kept
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
                runs = self.allocate(pages, evicted, tenant)
            if runs is None:
                statuses.append(AllocStatus.NO_SPACE)
                locations.append(None)
                continue
            entry = ChunkEntry(key, ns_id, size, runs, pages, ChunkState.WRITING, tenant)
            entry.last_access = now
            self.add_writing(entry)
            written.append(entry)
            statuses.append(AllocStatus.ALLOCATED)
            locations.append(self.location(entry))
        return statuses, locations, written

    def quota_room(
        self,
        tenant: Tenant,
        need: int,
        pages_each: int,
        keys: Sequence[bytes],
        evicted: list[ChunkEntry],
    ) -> None:
        """Before ``tenant`` allocates ``need`` pages in chunks of ``pages_each``: if that
        takes it over its quota, evict its own coldest chunks, enough for as many of the
        chunks as can then fit (nothing when not even one could). The batch's own chunks
        (``keys``: being re-put, the prefix it extends) are kept."""
        room = tenant.room()
        if room is None or need <= room:
            return
        keep = set(keys)
        kept = 0
        for key in keep:
            entry = self.table.get(key)
            if entry is not None and entry.tenant is tenant and entry.pins == 0:
                kept += entry.pages if entry.state is ChunkState.COMMITTED else 0
        fit = min(need, room + tenant.evictable - kept) // pages_each * pages_each
        if fit > room:
            self.evict_own(tenant, fit - room, keep, evicted)

    def evict_own(
        self, tenant: Tenant, pages: int, keep: set[bytes], evicted: list[ChunkEntry]
    ) -> None:
        """Evict ``tenant``'s own coldest unpinned chunks (not those in ``keep``) until
        ``pages`` are freed or none is left: how a tenant at its quota makes room. One pass
        over the policy's order, however many chunks go."""
        victims: list[ChunkEntry] = []
        freed = 0
        for key in self.policy.coldest(self.evictable):
            if freed >= pages:
                break
            entry = self.table[cast(bytes, key)]
            if entry.tenant is tenant and entry.key not in keep:
                victims.append(entry)
                freed += entry.pages
        for entry in victims:
            self.policy.remove(entry.key)
            self.counters["quota_evictions"] += 1
            self._evicted(entry, evicted)

    def _evicted(self, entry: ChunkEntry, evicted: list[ChunkEntry]) -> None:
        self.counters["evictions"] += 1
        evicted.append(entry)
        self.unlink(entry)

    def evictable(self, key: Hashable) -> bool:
        entry = self.table[cast(bytes, key)]
        return entry.pins == 0 and (
            self.view_pins is None or not self.view_pins.pinned(entry.serial)
        )

    def unpinned(self, key: Hashable) -> bool:
        """No store lease pins it (what demotion may copy; eviction asks ``evictable``)."""
        return self.table[cast(bytes, key)].pins == 0

    def _evictable_for(self, tenant: Tenant) -> IsEvictable:
        may_take = self.tenants.may_take
        evictable_here = self.evictable

        def evictable(key: Hashable) -> bool:
            entry = self.table[cast(bytes, key)]
            return evictable_here(key) and may_take(tenant, entry.tenant, entry.pages)

        return evictable

    def add_writing(self, entry: ChunkEntry) -> None:
        """A chunk just allocated (WRITING, owned by a write lease) enters the table."""
        self.table[entry.key] = entry
        self.live[entry.namespace] = self.live.get(entry.namespace, 0) + 1
        self.pages["writing"] += entry.pages
        entry.tenant.writing += entry.pages

    def rekey(self, entry: ChunkEntry, ns_id: bytes, key: bytes) -> bool:
        """A chunk being written (a placeholder an engine holds pool space under) takes the
        name ``key`` in namespace ``ns_id`` (the same tenant's, the same chunk size: the caller
        checks) before it commits. False, and nothing changed, when ``key`` is in the table
        already (the caller drops the placeholder: that chunk is stored or being stored)."""
        if key in self.table:
            return False
        del self.table[entry.key]  # (never doomed: a deleted placeholder is not renamed)
        self.table[key] = entry
        self._gone(entry)
        self.live[ns_id] = self.live.get(ns_id, 0) + 1
        entry.key, entry.namespace = key, ns_id
        return True

    def commit(self, entry: ChunkEntry, checksum: int) -> bool:
        """A written chunk becomes readable; False when it was deleted meanwhile (freed)."""
        self.pages["writing"] -= entry.pages
        entry.tenant.writing -= entry.pages
        if entry.doomed:
            self.free(entry)
            return False
        entry.state = ChunkState.COMMITTED
        entry.checksum = checksum
        entry.serial = next(self._serials)
        self.by_serial[entry.serial] = entry
        self.pages["committed"] += entry.pages
        entry.tenant.committed += entry.pages
        self.policy.insert(entry.key, entry.pages)
        return True

    def pin(self, entry: ChunkEntry) -> None:
        if entry.pins == 0:
            self.pages["pinned"] += entry.pages
            entry.tenant.pinned += entry.pages
        entry.pins += 1

    def unpin(self, entry: ChunkEntry) -> None:
        entry.pins -= 1
        if entry.pins:
            return
        if entry.doomed:
            if entry.held_since >= 0:
                return  # an engine's pin still holds it (release_view_held frees it)
            self.pages["doomed"] -= entry.pages
            self.free(entry)
        else:
            self.pages["pinned"] -= entry.pages
            entry.tenant.pinned -= entry.pages

    def unlink(self, entry: ChunkEntry) -> None:
        """Take an entry out of the table; free its pages unless a lease still uses them."""
        del self.table[entry.key]
        entry.doomed = True
        if entry.state is ChunkState.WRITING:
            return  # its write lease frees it (commit, abort or expiry)
        self.by_serial.pop(entry.serial, None)
        self.pages["committed"] -= entry.pages
        entry.tenant.committed -= entry.pages
        if self.view_pins is not None and self.view_pins.pinned(entry.serial):
            entry.held_since = self.now()
            self.view_held.append(entry)
        if entry.pins:
            self.pages["pinned"] -= entry.pages
            entry.tenant.pinned -= entry.pages
        if entry.pins or entry.held_since >= 0:
            self.pages["doomed"] += entry.pages
        else:
            self.free(entry)

    def release_view_held(self, now: float) -> None:
        """Free the chunks unlinked under an engine's pin whose pins are gone."""
        if not self.view_held or self.view_pins is None:
            return
        if all(now - e.held_since < HOLD_MIN_S for e in self.view_held):
            return
        pinned = self.view_pins.holding()
        kept = []
        for entry in self.view_held:
            if now - entry.held_since < HOLD_MIN_S or entry.serial in pinned:
                kept.append(entry)
                continue
            entry.held_since = -1.0
            if not entry.pins:
                self.pages["doomed"] -= entry.pages
                self.free(entry)
        self.view_held = kept

    def drop_writing(
        self, entries: list[ChunkEntry], quarantine_until: float | None = None
    ) -> None:
        for entry in entries:
            self.pages["writing"] -= entry.pages
            entry.tenant.writing -= entry.pages
            if not entry.doomed:
                del self.table[entry.key]
                entry.doomed = True
            if quarantine_until is None:
                self.free(entry)
            else:
                self.pages["quarantined"] += entry.pages
                self.quarantine_seq += 1
                heapq.heappush(self.quarantine, (quarantine_until, self.quarantine_seq, entry.runs))
                entry.runs = []
                self.counters["quarantined"] += 1
                self._gone(entry)  # its pages are the quarantine's now, not its namespace's

    def free(self, entry: ChunkEntry) -> None:
        """Give back the pages of an entry nothing references any more (once per entry)."""
        self.alloc.free(entry.runs)
        entry.runs = []
        self._gone(entry)

    def _gone(self, entry: ChunkEntry) -> None:
        left = self.live[entry.namespace] - 1
        if left:
            self.live[entry.namespace] = left
        else:
            del self.live[entry.namespace]

    def location(self, entry: ChunkEntry) -> ChunkLocation:
        extents = []
        remaining = entry.size
        for start, length in entry.runs:
            nbytes = min(length * self.page_size, remaining)
            extents.append((start * self.page_size, nbytes))
            remaining -= nbytes
        return ChunkLocation(entry.key, entry.size, tuple(extents), entry.checksum)

    def stats(self) -> dict[str, int | str]:
        page = self.page_size
        committed_chunks = sum(1 for e in self.table.values() if e.state is ChunkState.COMMITTED)
        return {
            "eviction": self.policy.name,
            "used_bytes": self.alloc.used_pages * page,
            "free_bytes": self.alloc.free_pages * page,
            "committed_bytes": self.pages["committed"] * page,
            "pinned_bytes": self.pages["pinned"] * page,
            "writing_bytes": self.pages["writing"] * page,
            "doomed_bytes": self.pages["doomed"] * page,
            "quarantined_bytes": self.pages["quarantined"] * page,
            "largest_free_run_bytes": self.alloc.largest_free_run() * page,
            "chunks": committed_chunks,
            "writing_chunks": len(self.table) - committed_chunks,
        }

    def check(self) -> None:
        """Assert the page accounting adds up, in total and per tenant."""
        pages = self.pages
        total = pages["committed"] + pages["writing"] + pages["doomed"] + pages["quarantined"]
        assert total == self.alloc.used_pages, (pages, self.alloc.used_pages)
        assert self.alloc.used_pages <= self.alloc.num_pages
        table = self.table.values()
        pinned = sum(e.pages for e in table if e.state is ChunkState.COMMITTED and e.pins > 0)
        assert pinned == pages["pinned"], (pinned, pages)
        committed = [e for e in table if e.state is ChunkState.COMMITTED]
        assert len(committed) == len(self.policy)
        assert all(e.key in self.policy for e in committed)
        tenants = self.tenants.all()
        for state in ("writing", "committed", "pinned"):
            assert sum(getattr(t, state) for t in tenants) == pages[state], (state, pages)
        in_table: dict[bytes, int] = {}
        for entry in table:
            in_table[entry.namespace] = in_table.get(entry.namespace, 0) + 1
        live = self.live
        assert all(live.get(ns, 0) >= n for ns, n in in_table.items()), (in_table, live)
