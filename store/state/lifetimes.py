"""How leases and sessions end, apart from how a lease begins (a leased lookup, an allocation:
``StoreCore``): a holder releases or renews its lease; a client opens, heartbeats and closes
its session (``kvtier.store.state.sessions``), and every lease of a session ends with it; time
ends what nobody ended (``expire``: leases past their TTL, sessions without a heartbeat,
quarantined pages, pages an engine's pin no longer holds).

``Lifetimes`` holds no state of its own: it works on ``StoreCore``'s components under
``StoreCore``'s lock, so it is ``core.lifetimes`` and nothing else builds one. ``StoreCore``
keeps the public methods (its API answers through them) and calls ``expire`` first in every
operation.

Threading: every public method takes the store's lock; call from any thread. ``expire`` is
called with the lock held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvtier.store.api.types import LeaseStatus
from kvtier.store.state.leases import LeaseTable
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.pages import PageBook
from kvtier.store.state.sessions import SessionTable


class Lifetimes:
    def __init__(
        self,
        lock: threading.RLock,
        clock: Callable[[], float],
        pages: PageBook,
        leases: LeaseTable,
        sessions: SessionTable,
        limits: StoreLimits,
        counters: dict[str, int],
    ) -> None:
        self._lock = lock
        self._clock = clock
        self.pages = pages
        self.leases = leases
        self.sessions = sessions
        self.limits = limits
        self.counters = counters

    # -- leases ------------------------------------------------------------------------------

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        """End leases. A read lease released OK guarantees its chunks never changed meanwhile;
        EXPIRED means they may have (also when its session ended): the holder must discard
        what it copied."""
        self.limits.check_batch(len(lease_ids), "lease ids")
        with self._lock:
            self.expire(self._clock())
            return self.leases.release(lease_ids)

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Extend a lease; returns seconds until its new expiry: the TTL asked for, shortened
        to what is left of the lease's lifetime (``max_lease_lifetime_s`` from its creation).
        Past that the lease is gone: LEASE_EXPIRED."""
        with self._lock:
            now = self._clock()
            self.expire(now)
            return self.leases.extend(lease_id, ttl_s, now)

    # -- sessions ----------------------------------------------------------------------------

    def open_session(self) -> int:
        """A new client session (LIMIT_EXCEEDED past ``max_sessions``); heartbeat it within
        ``session_timeout_s``, or it ends with every lease created under it."""
        with self._lock:
            now = self._clock()
            self.expire(now)
            session = self.sessions.open(now)
            self.counters["sessions_opened"] += 1
            return session

    def grant_pin_row(self, session: int) -> None:
        """Give ``session`` a row of the engines' pin table, if it has none and one is free:
        called for a node's engine (as its session opens, its leased lookups and allocations),
        not for a peer."""
        pins = self.pages.view_pins
        if pins is None or not session or pins.has_row(session):
            return
        with self._lock:
            if session in self.sessions:
                pins.assign(session)

    def heartbeat(self, session: int) -> bool:
        """Keep ``session`` alive. False if it is not open (closed or timed out: its leases
        are gone, and the client must open a new session)."""
        with self._lock:
            now = self._clock()
            self.expire(now)
            return self.sessions.touch(session, now)

    def close_session(self, session: int) -> int:
        """End ``session`` and its leases (read leases unpinned, write leases aborted).
        Returns how many leases that ended; 0 for a session not open."""
        with self._lock:
            self.expire(self._clock())
            if not self.sessions.close(session):
                return 0
            self.counters["sessions_closed"] += 1
            if self.pages.view_pins is not None:
                self.pages.view_pins.session_ended(session)
            return self.leases.end_session(session)

    # -- time --------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """What time ended: quarantines, leases past their expiry, sessions without a
        heartbeat (with every lease of theirs). Called under the store's lock."""
        self.pages.release_quarantine(now)
        self.leases.expire(now)
        for session in self.sessions.pop_expired(now):
            self.counters["sessions_expired"] += 1
            self.leases.end_session(session)
            if self.pages.view_pins is not None:
                self.pages.view_pins.session_ended(session)
        self.pages.release_view_held(now)
