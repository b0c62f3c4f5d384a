"""Which chunks the node's disk holds: an in-memory table over the chunk files, rebuilt from
their headers when the store starts.

The files are the truth; the catalog is what the store consults on every stage (no directory
walk on the hot path). An entry is added only once its file is durable (``DiskBackend`` adds
it after the rename and the directory fsync), and removed before its file is unlinked, so a
stage that finds an entry may still find its file gone (a miss) but never finds a file that is
not yet whole.

Capacity: the sum of file sizes stays within ``capacity`` bytes; adding past it removes the
least recently used entries (a stage counts as a use), which the caller then unlinks.

Tenants, as in the pool (``kvtier.store.state.quotas``, counted in bytes of files here): a
file counts against the tenant of its namespace's ``cache_salt`` (the header's ``salt``). A
tenant at its ``disk_quota`` makes room from its own coldest files; the capacity is made from
the coldest file of any tenant that stays at or above its ``disk_floor`` afterwards (its own
always). A file no room can be made for is refused (returned as evicted, never recorded),
and so is a file larger than its tenant's quota. Recency is kept per tenant (one LRU list
each, stamped with a global use count), so choosing a victim costs O(tenants), not O(files).

Threading: thread-safe (one lock; no I/O under it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from kvtier.store.disk.files import (
    HEADER_BYTES,
    TMP_MARK,
    BadChunkFile,
    ChunkHeader,
    chunk_path,
    read_header,
)
from kvtier.store.state.quotas import Tenant, TenantBook, TenantLimits

log = logging.getLogger(__name__)

ChunkId = tuple[bytes, bytes]  # (namespace id, key)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    header: ChunkHeader
    path: Path

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.header.size


@dataclass(frozen=True, slots=True)
class ScanReport:
    chunks: int  # valid chunk files found
    bytes: int
    removed_partial: int  # leftover temporary files of writes a crash interrupted
    removed_bad: int  # files that failed their header check (torn, truncated, foreign)
    evicted: int  # valid files over capacity, least recently written first
    seconds: float


class DiskCatalog:
    def __init__(
        self,
        root: Path,
        capacity: int,
        tenants: Iterable[TenantLimits] = (),
        default_quota: int | None = None,
    ) -> None:
        self.root = root
        self.capacity = capacity
        self._lock = threading.Lock()
        # bytes as the book's "pages": quotas and floors are in bytes of chunk files
        self._book = TenantBook(1, capacity, tenants, default_quota)
        self._where: dict[ChunkId, Tenant] = {}
        self._lru: dict[Tenant, OrderedDict[ChunkId, tuple[DiskEntry, int]]] = {}
        self._uses = itertools.count()  # stamps: the coldest of the tenants' heads goes first
        self.used = 0
        self.quota_evictions = 0  # files a tenant at its disk quota removed of its own
        self.refused = 0  # files not recorded: over their tenant's quota, or floors left no room

    # -- start-up ----------------------------------------------------------------------------

    def scan(self) -> ScanReport:
        """Rebuild the table from the files under ``root`` (oldest first, so the least recently
        written are evicted first), removing partial writes and files that are not valid."""
        start = time.perf_counter()
        found: list[tuple[float, DiskEntry]] = []
        partial = bad = 0
        for path in self._files():
            if TMP_MARK in path.name:
                path.unlink(missing_ok=True)
                partial += 1
                continue
            try:
                header = read_header(path)
                if chunk_path(self.root, header.ns_id, header.key) != path:
                    raise BadChunkFile("file is not where its chunk belongs")
                found.append((path.stat().st_mtime, DiskEntry(header, path)))
            except (BadChunkFile, OSError) as exc:
                log.warning("disk tier: removing %s: %s", path, exc)
                path.unlink(missing_ok=True)
                bad += 1
        found.sort(key=lambda item: item[0])
        evicted: list[DiskEntry] = []
        with self._lock:
            for _, entry in found:
                evicted += self._add(entry)
        for entry in evicted:
            entry.path.unlink(missing_ok=True)
        report = ScanReport(
            len(self._where),
            self.used,
            partial,
            bad,
            len(evicted),
            time.perf_counter() - start,
        )
        return report

    def _files(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for ns_dir in self.root.iterdir():
            if not ns_dir.is_dir() or ns_dir.is_symlink():
                continue
            for fan in ns_dir.iterdir():
                if fan.is_dir() and not fan.is_symlink():
                    yield from (p for p in fan.iterdir() if p.is_file() and not p.is_symlink())

    # -- the table ---------------------------------------------------------------------------

    def get(self, chunk: ChunkId, touch: bool = True) -> DiskEntry | None:
        with self._lock:
            tenant = self._where.get(chunk)
            if tenant is None:
                return None
            entry = self._lru[tenant][chunk][0]
            if touch:
                self._touch(tenant, chunk, entry)
            return entry

    def run(self, ns_id: bytes, keys: Sequence[bytes]) -> list[DiskEntry]:
        """The entries of the leading run of ``keys`` held on disk (each counted as a use)."""
        out: list[DiskEntry] = []
        with self._lock:
            for key in keys:
                tenant = self._where.get((ns_id, key))
                if tenant is None:
                    break
                entry = self._lru[tenant][(ns_id, key)][0]
                self._touch(tenant, (ns_id, key), entry)
                out.append(entry)
        return out

    def _touch(self, tenant: Tenant, chunk: ChunkId, entry: DiskEntry) -> None:
        lru = self._lru[tenant]
        lru[chunk] = (entry, next(self._uses))
        lru.move_to_end(chunk)

    def __contains__(self, chunk: ChunkId) -> bool:
        with self._lock:
            return chunk in self._where

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def admits(self, salt: str, file_bytes: int) -> bool:
        """Would ``add`` record a file of ``file_bytes`` for the tenant of ``salt``? (The spill
        thread asks before writing one, so a refused chunk is not written again each round.)"""
        with self._lock:
            tenant = self._book.tenant(salt)
            admitted = self._room_for(tenant, file_bytes, evict=False) is not None
            self._book.forget(salt)  # asked about, not recorded: no tenant made for nothing
            return admitted

    def add(self, entry: DiskEntry) -> list[DiskEntry]:
        """Record a durable chunk file; returns the entries removed to make room (the caller
        unlinks their files): ``entry`` itself when it was refused."""
        with self._lock:
            return self._add(entry)

    def _add(self, entry: DiskEntry) -> list[DiskEntry]:
        chunk = (entry.header.ns_id, entry.header.key)
        self._discard(chunk)
        tenant = self._book.tenant(entry.header.salt)
        evicted = self._room_for(tenant, entry.file_bytes, evict=True)
        if evicted is None:
            self.refused += 1
            self._book.forget(entry.header.salt)
            return [entry]
        self._where[chunk] = tenant
        self._lru.setdefault(tenant, OrderedDict())[chunk] = (entry, next(self._uses))
        tenant.committed += entry.file_bytes
        self.used += entry.file_bytes
        return evicted

    def _room_for(self, tenant: Tenant, size: int, evict: bool) -> list[DiskEntry] | None:
        """Make (``evict``) or check room for ``size`` more bytes of ``tenant``: its quota from
        its own coldest files, the capacity from the coldest file any floor lets go. None
        when there is no such room (nothing is removed then)."""
        if size > self.capacity or (tenant.quota is not None and size > tenant.quota):
            return None
        own = self._lru.get(tenant, OrderedDict())
        # What the quota makes this tenant give up, coldest first (planned before any is).
        quota_victims: list[DiskEntry] = []
        if tenant.quota is not None:
            over = tenant.held + size - tenant.quota
            for entry, _ in own.values():
                if over <= 0:
                    break
                quota_victims.append(entry)
                over -= entry.file_bytes
        freed = sum(e.file_bytes for e in quota_victims)
        short = self.used - freed + size - self.capacity
        capacity_victims = self._capacity_victims(tenant, short, len(quota_victims))
        if capacity_victims is None:
            return None
        if evict:  # the requester's tenant is kept in the book: its new file is recorded next
            for entry in quota_victims:
                self._discard((entry.header.ns_id, entry.header.key), forget=False)
                self.quota_evictions += 1
            for entry in capacity_victims:
                mine = self._where[(entry.header.ns_id, entry.header.key)] is tenant
                self._discard((entry.header.ns_id, entry.header.key), forget=not mine)
        return quota_victims + capacity_victims

    def _capacity_victims(
        self, tenant: Tenant, short: int, skip_own: int
    ) -> list[DiskEntry] | None:
        """The coldest files, of ``tenant`` (past its first ``skip_own``, already given up
        for its quota) or of tenants their floors let go, that free ``short`` bytes."""
        if short <= 0:
            return []
        heads = {
            t: itertools.islice(lru.values(), skip_own if t is tenant else 0, None)
            for t, lru in self._lru.items()
        }
        nexts = {t: next(it, None) for t, it in heads.items()}
        held = {t: t.held for t in nexts}
        out: list[DiskEntry] = []
        while short > 0:
            best: tuple[int, Tenant] | None = None
            for t, item in nexts.items():
                if item is None:
                    continue
                entry, stamp = item
                may = t is tenant or held[t] - entry.file_bytes >= t.floor
                if may and (best is None or stamp < best[0]):
                    best = (stamp, t)
            if best is None:
                return None
            victim_tenant = best[1]
            entry = cast(tuple[DiskEntry, int], nexts[victim_tenant])[0]
            out.append(entry)
            short -= entry.file_bytes
            held[victim_tenant] -= entry.file_bytes
            nexts[victim_tenant] = next(heads[victim_tenant], None)
        return out

    def discard(self, chunk: ChunkId) -> DiskEntry | None:
        """Forget a chunk (its file failed, or is being removed); returns what was known."""
        with self._lock:
            return self._discard(chunk)

    def _discard(self, chunk: ChunkId, forget: bool = True) -> DiskEntry | None:
        """Forget a chunk; and an unlisted tenant left with no file (unless not ``forget``)."""
        tenant = self._where.pop(chunk, None)
        if tenant is None:
            return None
        lru = self._lru[tenant]
        entry, _ = lru.pop(chunk)
        if not lru:
            del self._lru[tenant]
        tenant.committed -= entry.file_bytes
        self.used -= entry.file_bytes
        if forget:
            self._book.forget(entry.header.salt)
        return entry

    def held(self) -> dict[bytes, list[bytes]]:
        """Every chunk on disk: namespace id -> keys (the store's snapshot)."""
        out: dict[bytes, list[bytes]] = {}
        with self._lock:
            for ns_id, key in self._where:
                out.setdefault(ns_id, []).append(key)
        return out

    def take_all(self) -> list[DiskEntry]:
        """Forget every entry (clearing the store); the caller unlinks their files."""
        with self._lock:
            out = [entry for lru in self._lru.values() for entry, _ in lru.values()]
            for chunk in list(self._where):
                self._discard(chunk)
        return out

    def coldest(self, count: int) -> list[DiskEntry]:
        """Up to ``count`` entries, least recently used first (freeing space on ENOSPC)."""
        with self._lock:
            heads = (item for lru in self._lru.values() for item in lru.values())
            return [entry for entry, _ in heapq.nsmallest(count, heads, key=lambda i: i[1])]

    def tenant_stats(self) -> dict[str, int]:
        """Bytes of files per tenant name, and the named tenants' disk quotas and floors."""
        with self._lock:
            return {f"disk_{name}": value for name, value in self._book.stats().items()}
