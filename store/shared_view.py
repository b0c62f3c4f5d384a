"""The store's side of what the node's engines read without calling it: the view of its
chunks (``kvtier.store.client.view``) and, beside it, the lease region where engines lease
pool hits themselves (``kvtier.store.client.view_leases``; its layout and extent map:
``kvtier.store.client.lease_region``), both at the end of the pool segment, kept in step with
the store's state through its event log.

Threading: the view and the map change only inside the event log's lock (its observer, or
``with core.events.lock``), which the store takes under its own; the pin table only under the
store's lock (``StoreCore`` calls it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvtier.core.config.store import StoreConfig
from kvtier.store.client.lease_region import (
    PAGE,
    ExtentMapWriter,
    RegionShape,
    check_of,
    region_shape,
)
from kvtier.store.client.pin_table import PinTable
from kvtier.store.client.shm import SHM_DIR, SharedSegment
from kvtier.store.client.view import (
    COVERS_DISK,
    COVERS_POOL,
    ChunkViewWriter,
    Record,
    add_held,
    follow_events,
    tag_of,
    view_bytes_for,
)
from kvtier.store.state.core import StoreCore
from kvtier.store.state.entries import ChunkEntry, ChunkState

VIEW_DISK_BYTES = 1 << 20  # disk bytes per slot of the shared view
MAP_CHUNK_BYTES = 256 << 10  # the map holds a chunk per this many pool bytes (a page at least)


def view_layout(
    config: StoreConfig, pool_bytes: int, page_size: int
) -> tuple[int, RegionShape | None]:
    """(bytes of the view, the lease region's shape or None: it starts at the next page)."""
    # one slot per pool page (a chunk takes a page or more) and per MiB of the disk tier,
    # which it covers too (a model's chunk is MiBs; a disk of smaller ones overfills the
    # view, which then answers nothing)
    pages = pool_bytes // page_size
    slots = pages
    if config.disk.enabled:
        slots += int(config.disk.capacity) // max(page_size, VIEW_DISK_BYTES)
    view = view_bytes_for(slots)
    if not config.view_leases:
        return view, None
    chunks = min(pages, max(4096, pool_bytes // MAP_CHUNK_BYTES))
    pins = config.view_lease_pins
    return view, region_shape(chunks, config.view_lease_sessions, pins, pins)


class SharedView:
    """The view (and lease region, with ``store.view_leases``) of one store incarnation."""

    def __init__(
        self,
        config: StoreConfig,
        core: StoreCore,
        segment: SharedSegment,
        offset: int,
        max_age_s: float,
    ) -> None:
        self.core = core
        view_bytes, shape = view_layout(config, core.capacity_bytes, core.page_size)
        words = segment.array[offset : offset + view_bytes].view(np.uint64)
        region_at = -(-view_bytes // PAGE) * PAGE
        self.writer = ChunkViewWriter(
            words,
            core.epoch,
            config.max_batch_keys,
            max_age_s,
            COVERS_POOL | (COVERS_DISK if config.disk.enabled else 0),
            region_offset=region_at if shape is not None else 0,
        )
        self.pins: PinTable | None = None
        self._lock_fd = -1
        if shape is not None:
            start = offset + region_at
            region = segment.array[start : start + shape.nbytes].view(np.uint64)
            self.writer.extents = ExtentMapWriter(
                region, shape, core.page_size, config.max_lease_ttl_s
            )
            self._lock_fd = os.open(SHM_DIR / segment.name, os.O_RDONLY)
            self.pins = PinTable(region, self._lock_fd)
            core.attach_view_pins(self.pins)
            core.upkeep.on_checksums = self._checksummed
        core.events.observer = follow_events(self.writer, self._record)

    @staticmethod
    def nbytes(config: StoreConfig, pool_bytes: int, page_size: int) -> int:
        view_bytes, shape = view_layout(config, pool_bytes, page_size)
        if shape is None:
            return view_bytes
        return -(-view_bytes // PAGE) * PAGE + shape.nbytes

    def _record(self, ns_id: bytes, key: bytes) -> Record | None:
        """A pool chunk just stored, as the map holds it (under the store's lock)."""
        if self.pins is None:
            return None
        entry = self.core.pages.held(key, ns_id)
        if entry is None or entry.state is not ChunkState.COMMITTED:
            return None
        return (check_of(ns_id, key), entry.serial, entry.size, entry.checksum, entry.runs)

    def _checksummed(self, entries: Sequence[ChunkEntry]) -> None:
        items = [(tag_of(e.namespace, e.key), e.serial, e.checksum) for e in entries if e.serial]
        with self.core.events.lock:
            self.writer.set_checksums(items)

    def add_disk_held(self, held: dict[bytes, list[bytes]]) -> None:
        """The disk's chunks a restarted store found, before engines map the view."""
        with self.core.events.lock:
            add_held(self.writer, held, COVERS_DISK)

    def alive(self) -> None:
        self.writer.alive()  # engines trust the view only while this moves

    def stats(self) -> dict[str, int]:
        out = {"view_overfull": int(self.writer.overfull)}
        if self.pins is not None and self.writer.extents is not None:
            out["view_unmapped_chunks"] = self.writer.extents.unmapped
            out["view_lock_misses"] = self.pins.lock_misses
            out["view_pins_expired"] = self.pins.expired
        return out

    def close(self) -> None:
        with self.core.events.lock:  # after the last change it was told of
            self.writer.retire()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
