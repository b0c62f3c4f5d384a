"""Client sessions: the liveness of a store client, so a dead client's leases end in seconds.

A lease alone outlives its holder by up to its TTL, and clients ask for long ones (a load may
take minutes): a killed engine's pins would block eviction that long. A client therefore
opens a session, heartbeats it (every ``timeout_s / 3`` or so), and creates its leases under
it; when the session ends (the client closes it, or no heartbeat arrives for ``timeout_s``)
the store ends every lease of the session at once (``LeaseTable.end_session``). What one
session holds is bounded (``store.max_leases_per_session``,
``store.max_leased_chunks_per_session``), so over gRPC every lease belongs to a session (one
asked for without is refused). In-process callers (an embedded store, the remote tier's own
allocations) use session id 0: TTL-only leases.

Session ids are random 63-bit numbers: a client cannot guess, and so end, another's session.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import heapq

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.state.ids import RandomIds


class SessionTable:
    def __init__(self, timeout_s: float, max_sessions: int = 65536) -> None:
        if not timeout_s > 0:
            raise ValueError(f"session timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_sessions = max_sessions
        self._expires: dict[int, float] = {}  # session id -> deadline of its next heartbeat
        # (deadline, id); stale entries (a later heartbeat moved the deadline) are skipped.
        self._heap: list[tuple[float, int]] = []
        self._ids = RandomIds()

    def __len__(self) -> int:
        return len(self._expires)

    def __contains__(self, session: int) -> bool:
        return session in self._expires

    def check(self, session: int) -> None:
        """UNKNOWN_SESSION unless ``session`` is open (0, no session, always passes)."""
        if session and session not in self._expires:
            raise KvtierError(
                ErrorCode.UNKNOWN_SESSION,
                f"session {session:x} is not open (closed, or no heartbeat for "
                f"{self.timeout_s} s): open a new one",
            )

    def open(self, now: float) -> int:
        if len(self._expires) >= self.max_sessions:
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(self._expires)} sessions open: store.max_sessions = {self.max_sessions}",
            )
        session = self._ids.draw()
        while session in self._expires:
            session = self._ids.draw()
        self._push(session, now + self.timeout_s)
        return session

    def touch(self, session: int, now: float) -> bool:
        """A heartbeat: the session lives ``timeout_s`` more (at least 7/8 of it: a deadline
        moved by less is not re-queued). False if it is not open (never opened, closed, or
        already timed out: the client must open a new one)."""
        if session not in self._expires:
            return False
        deadline = now + self.timeout_s
        # Push only when the deadline moved noticeably, so a chatty client cannot grow the heap.
        if deadline - self._expires[session] > self.timeout_s / 8:
            self._push(session, deadline)
        return True

    def close(self, session: int) -> bool:
        """End a session now. False if it was not open."""
        return self._expires.pop(session, None) is not None

    def pop_expired(self, now: float) -> list[int]:
        """Remove and return the sessions whose heartbeat deadline has passed."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, session = heapq.heappop(heap)
            if self._expires.get(session) != deadline:
                continue  # closed, or heartbeaten since (a later entry exists)
            del self._expires[session]
            out.append(session)
        return out

    def _push(self, session: int, deadline: float) -> None:
        self._expires[session] = deadline
        heapq.heappush(self._heap, (deadline, session))
