"""The node store's disk tier: cold chunks copied to local files before eviction takes them,
and staged back into the pool when a prompt needs them.

    spill (a background thread, every ``interval_s``)
      while the pool is fuller than ``high_watermark`` (always, with ``write_through``): pin
      the chunks among the coldest ``1 - high_watermark`` of the pool (what eviction takes
      next) that are not on disk yet, write each to its file (``files.write_chunk``), fsync
      the directories, record them in the catalog, unpin. They stay in the pool: eviction
      later drops them from DRAM and loses nothing.

    stage(ns_id, keys)   (the ``StageFromDisk`` call a connector's ``disk`` tier makes)
      the leading run of ``keys`` on disk: allocate pool pages (a normal write lease), read
      the files into them in parallel, check every checksum, commit in order up to the first
      chunk that failed. The caller then looks the keys up and loads them like any DRAM hit.

Failures are misses, never wrong bytes: a file that is missing, short, torn, foreign or fails
its checksum, or an EIO while reading it, drops that chunk from the catalog (and its file),
and the stage stops there (FetchStatus CHECKSUM_MISMATCH / TRANSFER_FAILED). Writes that fail
(ENOSPC, EIO, a read-only filesystem) leave no file behind; on ENOSPC the least recently used
files are removed and the round ends, on any other error writing pauses for
``WRITE_BACKOFF_S`` (reads go on). Every stage ends within its deadline plus one file read.

Restart: the catalog is rebuilt from the files' headers (``DiskCatalog.scan``) before the
store serves anything; a chunk's namespace id is its namespace's root key, the same in every
incarnation, so a store started again (cleanly or after ``kill -9``) serves the same hits.

One store per directory: an exclusive ``flock`` on ``<path>/.lock`` (released by the kernel
when the store dies).

Threading: ``stage`` runs on several gRPC threads at once; one spill thread. The catalog and
the store's core each have their own lock; no file I/O happens under either.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.core.chunks import ChunkLocation, extent_pieces
from kvtier.core.config.store import DiskConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.api.remote import FetchResult, FetchStatus
from kvtier.store.api.types import AllocStatus
from kvtier.store.client.shm import SharedSegment, checksum_views
from kvtier.store.disk.catalog import DiskCatalog, DiskEntry, ScanReport
from kvtier.store.disk.files import (
    HEADER_BYTES,
    BadChunkFile,
    ChunkHeader,
    chunk_path,
    fsync_dirs,
    read_chunk_into,
    write_chunk,
)
from kvtier.store.remote.demotion import settled_used
from kvtier.store.state.core import StoreCore
from kvtier.store.state.entries import NamespaceInfo
from kvtier.store.state.quotas import TenantLimits

log = logging.getLogger(__name__)

WRITE_BACKOFF_S = 30.0  # after a write error other than ENOSPC (EIO, EROFS): no writes
STAGE_WRITE_TTL_S = 30.0  # pool pages allocated for a stage must be committed within this
COUNTERS = (
    "spilled_chunks",
    "spilled_bytes",
    "write_seconds",
    "write_errors",
    "staged_chunks",
    "staged_bytes",
    "stage_calls",
    "read_seconds",
    "read_errors",
    "bad_files",
    "evicted_files",
)


@dataclass(frozen=True, slots=True)
class SpillRound:
    chunks: int
    bytes: int
    message: str = ""


class DiskBackend:
    def __init__(
        self,
        core: StoreCore,
        segment: SharedSegment,
        config: DiskConfig,
        tenants: Sequence[TenantLimits] = (),
    ) -> None:
        assert config.path is not None  # DiskConfig refuses enabled without a path
        self.core = core
        self.segment = segment
        self.config = config
        self.root = Path(config.path)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.root)
        self.catalog = DiskCatalog(
            self.root,
            int(config.capacity),
            tenants,
            None if config.default_quota is None else int(config.default_quota),
        )
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.spill_queue = 0  # chunks the last spill round found to copy (at most a batch)
        # told each chunk file's ("write", fsync included, or "read") seconds: the store's
        # /metrics histogram (``kvtier.store.server.metrics``); called on the writing or
        # reading thread, so it must be cheap and thread-safe (a prometheus ``observe``)
        self.on_file_timed: Callable[[str, float], None] | None = None
        self._counter_lock = threading.Lock()
        self._write_lock = threading.Lock()  # one spill round at a time
        self._writes_paused_until = 0.0
        self.last_write_error = ""
        self._readers = ThreadPoolExecutor(config.read_threads, thread_name_prefix="kvtier-disk")
        self.scan: ScanReport = self.catalog.scan()
        # lock order: the store's, then the catalog's (never the other way round)
        core.upkeep.prefer_evicting(lambda ns_id, key: (ns_id, key) in self.catalog)
        log.info(
            "disk tier at %s: %d chunks (%d bytes) found in %.2fs; removed %d partial, %d bad",
            self.root,
            self.scan.chunks,
            self.scan.bytes,
            self.scan.seconds,
            self.scan.removed_partial,
            self.scan.removed_bad,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-disk-spill", daemon=True)
        self._thread.start()

    # -- spilling ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                while not self._stop.is_set() and self.spill_once().chunks:
                    pass  # keep going while there is something to copy
            except Exception:  # pragma: no cover - keep spilling after a bug report
                log.exception("disk tier: spill round failed")

    def spill_window(self) -> int:
        """Bytes at the cold end of the pool that should be on disk now (0: none)."""
        stats = self.core.stats()
        capacity = int(stats["capacity_bytes"])
        if self.config.write_through:
            return capacity
        if settled_used(stats) <= self.config.high_watermark * capacity:
            return 0
        return max(1, int((1 - self.config.high_watermark) * capacity))

    def spill_once(self) -> SpillRound:
        """Copy the chunks eviction would take next that are not on disk yet (one batch)."""
        with self._write_lock:
            if time.monotonic() < self._writes_paused_until:
                return SpillRound(0, 0, f"writes paused: {self.last_write_error}")
            window = self.spill_window()
            if not window:
                return SpillRound(0, 0, "below the high watermark")
            capacity = self.core.capacity_bytes
            limit = min(
                int(self.config.max_batch_bytes), int(capacity * self.config.max_pool_share)
            )
            batch = self.core.upkeep.pin_coldest(window, limit, self._skip)
            self.spill_queue = len(batch)
            if not batch:
                return SpillRound(0, 0, "nothing to copy")
            written: list[DiskEntry] = []
            try:
                written = self._write(batch)
            finally:
                self.core.upkeep.unpin([entry for entry, _ in batch])
            evicted: list[DiskEntry] = []
            for entry in written:
                evicted += self.catalog.add(entry)
            self._remove_files(evicted)
            # a file refused by its tenant's quota (or the others' floors) was never stored
            refused = {_id(entry) for entry in evicted} & {_id(entry) for entry in written}
            stored = [entry for entry in written if _id(entry) not in refused]
            # logged after the catalog changed (``NodeStore.snapshot`` relies on that order)
            self._log(EventKind.STORED, stored)
            self._log(EventKind.REMOVED, [e for e in evicted if _id(e) not in refused])
            moved = sum(entry.header.size for entry in stored)
            self._count(spilled_chunks=len(stored), spilled_bytes=moved)
            return SpillRound(len(stored), moved)

    def _skip(self, ns_id: bytes, key: bytes) -> bool:
        """Not to be copied: on disk already, or its tenant's disk quota and the others'
        floors leave it no room (it would be written and refused, again every round)."""
        if (ns_id, key) in self.catalog:
            return True
        info = self._namespace(ns_id)
        if info is None:  # retired: no one will ask for it
            return True
        return not self.catalog.admits(info.namespace.cache_salt, HEADER_BYTES + info.chunk_bytes)

    def _namespace(self, ns_id: bytes) -> NamespaceInfo | None:
        """What the namespace was registered with (its cache_salt names its tenant); None
        once it is retired."""
        try:
            return self.core.namespace(ns_id)
        except KvtierError:
            return None

    def _write(self, batch: list) -> list[DiskEntry]:
        """Write the pinned chunks' files; the ones durable when this returns."""
        done: list[DiskEntry] = []
        dirs: set[Path] = set()
        for entry, location in batch:
            info = self._namespace(entry.namespace)
            if info is None:  # retired meanwhile: no one will ask for it
                continue
            views = self._views(location)
            checksum = entry.checksum or checksum_views(views)
            salt = info.namespace.cache_salt
            header = ChunkHeader(entry.namespace, entry.key, entry.size, checksum, salt)
            path = chunk_path(self.root, entry.namespace, entry.key)
            start = time.perf_counter()
            try:
                write_chunk(path, header, views, fsync=self.config.fsync)
            except OSError as exc:
                self._write_failed(exc)
                break
            finally:
                self._timed("write", time.perf_counter() - start)
            dirs.update({path.parent, path.parent.parent})
            done.append(DiskEntry(header, path))
        if done and self.config.fsync:
            try:
                fsync_dirs(dirs | {self.root})
            except OSError as exc:  # names not durable: not on disk as far as anyone knows
                self._write_failed(exc)
                self._remove_files(done)
                return []
        return done

    def _write_failed(self, exc: OSError) -> None:
        self._count(write_errors=1)
        self.last_write_error = f"{errno.errorcode.get(exc.errno or 0, 'error')}: {exc}"
        if exc.errno == errno.ENOSPC:
            # the filesystem is fuller than our capacity says (shared disk): make room
            oldest = self.catalog.coldest(8)
            for entry in oldest:
                self.catalog.discard(_id(entry))
            self._log(EventKind.REMOVED, oldest)
            self._remove_files(oldest)
            log.warning("disk tier: no space left on %s; removed the oldest files", self.root)
        else:
            self._writes_paused_until = time.monotonic() + WRITE_BACKOFF_S
            log.warning("disk tier: write failed (%s); writes paused", self.last_write_error)

    # -- staging -----------------------------------------------------------------------------

    def stage(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        """Make the leading run of ``keys`` held on disk committed in the pool (see above)."""
        info = self.core.namespace(ns_id)  # UNKNOWN_NAMESPACE: the caller's mistake
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "duplicate keys in one stage")
        deadline = time.monotonic() + timeout_s
        self._count(stage_calls=1)
        # the run's chunks already in the pool stay there while the rest is allocated: its
        # later chunks are often the coldest in the pool (and, on disk too, eviction's first
        # choice); evicted by this stage, the run would end where they were (a write-back
        # pool's not yet copied) or read them back from disk in the caller's next round
        present, pinned = self.core.pin_committed(ns_id, keys)
        try:
            first = next((i for i, p in enumerate(present) if not p), len(keys))
            run = keys[first : first + self._max_stage(info.chunk_bytes)]
            entries = self.catalog.run(ns_id, run)
            # a file of another size is another namespace's layout: the run ends before it
            entries = list(
                itertools.takewhile(lambda e: e.header.size == info.chunk_bytes, entries)
            )
            status, message, fetched, moved = FetchStatus.OK, "", 0, 0
            if entries:
                status, message, fetched, moved = self._stage(ns_id, entries, deadline)
        finally:
            self.core.upkeep.unpin(pinned)
        present = self.core.committed_mask(ns_id, keys)
        local = next((i for i, p in enumerate(present) if not p), len(keys))
        if local < len(keys) and status is FetchStatus.OK:
            status, message = FetchStatus.HOLDER_MISS, "not on this node's disk"
        return FetchResult(
            status, local, fetched, moved, first + len(entries), 0, tuple(present), message
        )

    def _max_stage(self, chunk_bytes: int) -> int:
        """Chunks one stage may allocate: a batch over ``store.max_batch_fraction`` of the
        pool is refused when it does not fit in free space (``StoreLimits.check_share``)."""
        fraction = self.core.limits.max_batch_fraction
        if fraction >= 1:
            return self.core.limits.max_batch_keys
        pages = -(-chunk_bytes // self.core.page_size)
        pool_pages = self.core.capacity_bytes // self.core.page_size
        return max(1, int(fraction * pool_pages) // pages)

    def _stage(
        self, ns_id: bytes, entries: list[DiskEntry], deadline: float
    ) -> tuple[FetchStatus, str, int, int]:
        """Read ``entries`` into newly allocated pages; (first failure, its message, chunks
        and bytes committed). A chunk another writer stores meanwhile (EXISTS, IN_PROGRESS)
        is left to it; the pool being full of pinned chunks ends the run."""
        keys = [e.header.key for e in entries]
        alloc = self.core.allocate(ns_id, keys, [e.header.size for e in entries], STAGE_WRITE_TTL_S)
        status, message = FetchStatus.OK, ""
        jobs: list[tuple[DiskEntry, ChunkLocation]] = []
        for entry, st, loc in zip(entries, alloc.statuses, alloc.locations, strict=True):
            if st is AllocStatus.ALLOCATED and loc is not None:
                jobs.append((entry, loc))
            elif st is AllocStatus.NO_SPACE and status is FetchStatus.OK:
                status, message = FetchStatus.NO_SPACE, "no room in this pool"
            elif st is AllocStatus.IN_PROGRESS and status is FetchStatus.OK:
                status, message = FetchStatus.BUSY, "another writer is storing this chunk here"
        futures = [self._readers.submit(self._read, entry, loc, deadline) for entry, loc in jobs]
        commit_keys: list[bytes] = []
        checksums: list[int] = []
        give_back: list[bytes] = []
        for (entry, _), future in zip(jobs, futures, strict=True):
            outcome = future.result()  # bounded: one file each, the deadline checked first
            if isinstance(outcome, int):
                commit_keys.append(entry.header.key)
                checksums.append(outcome)
            else:
                give_back.append(entry.header.key)
                if status is FetchStatus.OK:
                    status, message = outcome
        if commit_keys:
            self.core.commit(alloc.lease_id, commit_keys, checksums)
        if give_back:  # fully read or never started: no late bytes, reuse the pages now
            self.core.abort(alloc.lease_id, give_back)
        committed = set(commit_keys)
        moved = sum(entry.header.size for entry, _ in jobs if entry.header.key in committed)
        self._count(staged_chunks=len(commit_keys), staged_bytes=moved)
        return status, message, len(commit_keys), moved

    def _read(
        self, entry: DiskEntry, location: ChunkLocation, deadline: float
    ) -> int | tuple[FetchStatus, str]:
        """Read one file into its pages: its checksum, or why not (the entry is dropped)."""
        if time.monotonic() > deadline:
            return FetchStatus.TIMEOUT, "stage deadline passed"
        start = time.perf_counter()
        try:
            return read_chunk_into(entry.path, entry.header, self._views(location))
        except BadChunkFile as exc:
            self._count(bad_files=1)
            log.warning("disk tier: %s: %s; dropped", entry.path, exc)
            self._drop(entry)
            return FetchStatus.CHECKSUM_MISMATCH, str(exc)
        except OSError as exc:  # gone (evicted meanwhile), EIO, ...
            self._count(read_errors=1)
            log.warning("disk tier: reading %s: %s; dropped", entry.path, exc)
            self._drop(entry)
            return FetchStatus.TRANSFER_FAILED, f"read failed: {exc.strerror or exc}"
        finally:
            self._timed("read", time.perf_counter() - start)

    def _timed(self, what: str, seconds: float) -> None:
        """One chunk file's ``what`` ("write" or "read") took ``seconds``: counted, observed."""
        self._count(**{f"{what}_seconds": seconds})
        if self.on_file_timed is not None:
            self.on_file_timed(what, seconds)

    def _views(self, location: ChunkLocation) -> list[np.ndarray]:
        array = self.segment.array
        return [
            array[offset : offset + length]
            for offset, length in extent_pieces(location.extents, 0, location.size)
        ]

    # -- housekeeping ------------------------------------------------------------------------

    def _drop(self, entry: DiskEntry) -> None:
        if self.catalog.discard(_id(entry)) is not None:
            self._log(EventKind.REMOVED, [entry])
            self._remove_files([entry])

    def _log(self, kind: EventKind, entries: Sequence[DiskEntry]) -> None:
        """Tell the store's event stream (the index follows it) what the disk gained or lost."""
        by_ns: dict[bytes, list[bytes]] = {}
        for entry in entries:
            by_ns.setdefault(entry.header.ns_id, []).append(entry.header.key)
        if by_ns:
            self.core.events.append(
                [StoreEvent(kind, ns, tuple(keys), tier="disk") for ns, keys in by_ns.items()]
            )

    def clear(self) -> int:
        """Remove every chunk file (the store is being cleared; its CLEARED event covers the
        disk, so nothing is logged here)."""
        with self._write_lock:
            entries = self.catalog.take_all()
            self._remove_files(entries)
        return len(entries)

    def _remove_files(self, entries: Sequence[DiskEntry]) -> None:
        for entry in entries:
            try:
                entry.path.unlink(missing_ok=True)
            except OSError as exc:  # read-only filesystem: the next scan tries again
                log.debug("disk tier: cannot remove %s: %s", entry.path, exc)
        self._count(evicted_files=len(entries))

    def _count(self, **deltas: float) -> None:
        with self._counter_lock:
            for name, value in deltas.items():
                self.counters[name] += value

    def stats(self) -> dict[str, int | float | str]:
        with self._counter_lock:
            out: dict[str, int | float | str] = {f"disk_{k}": v for k, v in self.counters.items()}
        out["disk_chunks"] = len(self.catalog)
        out["disk_spill_queue_chunks"] = self.spill_queue
        out["disk_used_bytes"] = self.catalog.used
        out["disk_capacity_bytes"] = self.catalog.capacity
        out["disk_last_write_error"] = self.last_write_error
        out["disk_quota_evictions"] = self.catalog.quota_evictions
        out["disk_refused_files"] = self.catalog.refused
        out.update(self.catalog.tenant_stats())
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._readers.shutdown(wait=True)
        os.close(self._lock_fd)


def _id(entry: DiskEntry) -> tuple[bytes, bytes]:
    return entry.header.ns_id, entry.header.key


def _lock_directory(root: Path) -> int:
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise KvtierError(
            ErrorCode.UNAVAILABLE, f"another store uses the disk tier directory {root}"
        ) from None
    return fd
