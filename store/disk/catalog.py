"""Which chunks the node's disk holds: an in-memory table over the chunk files, rebuilt from
their headers when the store starts.

The files are the truth; the catalog is what the store consults on every stage (no directory
walk on the hot path). An entry is added only once its file is durable (``DiskBackend`` adds
it after the rename and the directory fsync), and removed before its file is unlinked, so a
stage that finds an entry may still find its file gone (a miss) but never finds a file that is
not yet whole.

Capacity: the sum of file sizes stays within ``capacity`` bytes; adding past it evicts the
least recently used entries (a stage counts as a use), which the caller then unlinks.

Threading: thread-safe (one lock; no I/O under it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.store.disk.files import (
    HEADER_BYTES,
    TMP_MARK,
    BadChunkFile,
    ChunkHeader,
    chunk_path,
    read_header,
)

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
    def __init__(self, root: Path, capacity: int) -> None:
        self.root = root
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkId, DiskEntry] = OrderedDict()  # coldest first
        self.used = 0

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
            len(self._entries),
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
            entry = self._entries.get(chunk)
            if entry is not None and touch:
                self._entries.move_to_end(chunk)
            return entry

    def run(self, ns_id: bytes, keys: Sequence[bytes]) -> list[DiskEntry]:
        """The entries of the leading run of ``keys`` held on disk (each counted as a use)."""
        out: list[DiskEntry] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get((ns_id, key))
                if entry is None:
                    break
                self._entries.move_to_end((ns_id, key))
                out.append(entry)
        return out

    def __contains__(self, chunk: ChunkId) -> bool:
        with self._lock:
            return chunk in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, entry: DiskEntry) -> list[DiskEntry]:
        """Record a durable chunk file; returns the entries evicted to make room (the caller
        unlinks their files)."""
        with self._lock:
            return self._add(entry)

    def _add(self, entry: DiskEntry) -> list[DiskEntry]:
        chunk = (entry.header.ns_id, entry.header.key)
        old = self._entries.pop(chunk, None)
        if old is not None:
            self.used -= old.file_bytes
        self._entries[chunk] = entry
        self.used += entry.file_bytes
        evicted: list[DiskEntry] = []
        while self.used > self.capacity and self._entries:
            _, victim = self._entries.popitem(last=False)
            self.used -= victim.file_bytes
            evicted.append(victim)  # ``entry`` itself if it alone exceeds the capacity
        return evicted

    def discard(self, chunk: ChunkId) -> DiskEntry | None:
        """Forget a chunk (its file failed, or is being removed); returns what was known."""
        with self._lock:
            entry = self._entries.pop(chunk, None)
            if entry is not None:
                self.used -= entry.file_bytes
            return entry

    def held(self) -> dict[bytes, list[bytes]]:
        """Every chunk on disk: namespace id -> keys (the store's snapshot)."""
        out: dict[bytes, list[bytes]] = {}
        with self._lock:
            for ns_id, key in self._entries:
                out.setdefault(ns_id, []).append(key)
        return out

    def take_all(self) -> list[DiskEntry]:
        """Forget every entry (clearing the store); the caller unlinks their files."""
        with self._lock:
            out = list(self._entries.values())
            self._entries.clear()
            self.used = 0
        return out

    def coldest(self, count: int) -> list[DiskEntry]:
        """Up to ``count`` entries, least recently used first (freeing space on ENOSPC)."""
        with self._lock:
            out: list[DiskEntry] = []
            for entry in self._entries.values():
                if len(out) == count:
                    break
                out.append(entry)
            return out
