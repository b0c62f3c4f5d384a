"""What the store says about itself: its counts (``stats``: the store's stats page and
metrics), the committed chunks by namespace as of an event sequence number (``snapshot``:
where a follower of the event log starts), and whether its components agree
(``check_invariants``: tests and debug builds).

``StoreReporting`` is mixed into ``StoreCore`` rather than composed: the three are
``StoreCore``'s public methods and read a dozen of its components, which a helper would have
to be handed one by one only to forward three calls. It holds no state of its own: it reads
the attributes declared below, which ``StoreCore.__init__`` sets.

Threading: every public method takes the store's lock; call from any thread.
"""

from __future__ import annotations

import threading

from kvtier.store.api.types import Snapshot
from kvtier.store.state.checksums import ChecksumQueue
from kvtier.store.state.entries import ChunkState
from kvtier.store.state.eventlog import EventLog
from kvtier.store.state.leases import LeaseTable
from kvtier.store.state.namespaces import NamespaceTable
from kvtier.store.state.pages import PageBook
from kvtier.store.state.quotas import TenantBook
from kvtier.store.state.sessions import SessionTable


class StoreReporting:
    node_id: str
    epoch: int
    capacity_bytes: int
    page_size: int
    counters: dict[str, int]
    pages: PageBook
    tenants: TenantBook
    namespaces: NamespaceTable
    leases: LeaseTable
    sessions: SessionTable
    checksums: ChecksumQueue
    events: EventLog
    _lock: threading.RLock

    def snapshot(self) -> Snapshot:
        with self._lock:
            chunks: dict[bytes, list[bytes]] = {}
            for entry in self.pages.table.values():
                if entry.state is ChunkState.COMMITTED:
                    chunks.setdefault(entry.namespace, []).append(entry.key)
            return Snapshot(self.events.last_seq, chunks)

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            pages = self.pages.stats()
            return {
                "node_id": self.node_id,
                "epoch": self.epoch,
                "capacity_bytes": self.capacity_bytes,
                "page_size": self.page_size,
                **pages,
                "namespaces": len(self.namespaces),
                **self.leases.stats(),
                "sessions": len(self.sessions),
                "event_seq": self.events.last_seq,
                # committed chunks whose checksum the store has not computed yet (a lookup
                # with verify_loads ends before them)
                "unsummed_chunks": len(self.checksums),
                **self.counters,
                **self.tenants.stats(),
                **self._view_pin_stats(),
            }

    def _view_pin_stats(self) -> dict[str, int]:
        pins = self.pages.view_pins
        if pins is None:
            return {}
        # chunks engines pin themselves now; chunks out of the table whose pages a pin keeps
        return {
            "view_pinned_chunks": len(pins.holding()),
            "view_held_chunks": len(self.pages.view_held),
        }

    def check_invariants(self) -> None:
        """Assert that the components agree (tests and debug builds): the page accounting,
        tenants' holdings, namespaces against chunks, leases against namespaces."""
        with self._lock:
            self.pages.check()
            for tenant in self.tenants.all():
                held = sum(e.pages for e in self.pages.table.values() if e.tenant is tenant)
                assert held == tenant.held - self.leases.doomed_writing(tenant), tenant
                assert tenant.quota is None or tenant.held <= tenant.quota, tenant
            self.namespaces.check()
            live = self.pages.live
            for lease in self.leases.all():
                assert all(e.namespace in live for e in lease.entries), lease.id
