"""A store client's own session: the liveness of a ``GrpcStoreClient`` at its store.

On its first lease-creating call (a leased ``lookup``, ``allocate``, ``lease_for_peer``) the
client opens a session at the store, passes its id in every such call, and heartbeats it from
a daemon thread every ``session_timeout_s / 3``. If this process dies (SIGKILL, OOM) the
heartbeats stop and the store ends its leases within seconds instead of at their TTL: a killed
engine does not keep chunks pinned. An unknown session (timed out during a long pause, store
restarted) is replaced by a new one; the client's ``close()`` ends it. Against a store without
sessions (an older version) leases are TTL-only, as before.

``OwnSession`` holds the session's state and runs the heartbeats; the client makes the calls
and keeps the count of its sessions the store ended. It holds the client's methods weakly,
and the heartbeat thread holds it weakly: a client dropped without ``close()`` is collected,
its heartbeats stop, and its session times out.

Threading: thread-safe (one lock around the session's state; no call is made under it but
the one that opens the session).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from kvtier.core.errors import ErrorCode, KvtierError

T = TypeVar("T")


class OwnSession:
    def __init__(
        self,
        open_at_store: Callable[[], tuple[int, float]],
        heartbeat: Callable[[int], bool],
        count_ended: Callable[[], None],
    ) -> None:
        """``open_at_store``: the client's OpenSession call, answering (session id, its
        timeout in seconds); ``heartbeat``: its Heartbeat call (False: the store does not
        know the session); ``count_ended``: counts a session the store ended (called under
        this one's lock). Bound methods of the client, held weakly (``WeakMethod``)."""
        self._open_at_store = weakref.WeakMethod(open_at_store)
        self._heartbeat = weakref.WeakMethod(heartbeat)
        self._count_ended = weakref.WeakMethod(count_ended)
        self.session = 0  # 0 = none open yet
        self._timeout_s = 0.0
        self._supported = True
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._heartbeater: threading.Thread | None = None

    def get(self) -> int:
        """The session, opened now if none is (and the heartbeats started); 0: the store has
        no sessions, or the client is closed."""
        with self._lock:
            if self.session or not self._supported or self.closed.is_set():
                return self.session
            open_at_store = self._open_at_store()
            if open_at_store is None:  # the client is gone: nothing to lease for
                return 0
            try:
                session, timeout_s = open_at_store()
            except KvtierError as exc:
                if exc.code is ErrorCode.INTERNAL and exc.message.startswith("UNIMPLEMENTED"):
                    self._supported = False  # an older store: TTL-only leases
                    return 0
                raise
            self.session = session
            self._timeout_s = timeout_s
            if self._heartbeater is None or not self._heartbeater.is_alive():
                self._heartbeater = threading.Thread(
                    target=_heartbeat_loop,
                    args=(weakref.ref(self), self.closed, max(0.05, timeout_s / 3)),
                    name="kvtier-store-heartbeat",
                    daemon=True,
                )
                self._heartbeater.start()
            return self.session

    def run(self, session: int, call: Callable[[int], T]) -> T:
        """Run a lease-creating ``call(session)``: under the caller's ``session`` when given,
        else under this client's own (opened now if need be, and opened anew once if the
        store no longer knows it)."""
        if session:
            return call(session)
        own = self.get()
        try:
            return call(own)
        except KvtierError as exc:
            if exc.code is not ErrorCode.UNKNOWN_SESSION or not own:
                raise
            self.drop(own)
            return call(self.get())

    def drop(self, session: int) -> None:
        """Forget ``session`` (ended at the store): the next lease opens a new one."""
        with self._lock:
            if session and self.session == session:
                self.session = 0
                count_ended = self._count_ended()
                if count_ended is not None:
                    count_ended()

    def close(self) -> int:
        """No session opens from now on and the heartbeats stop. Returns the session to close
        at the store (0: none is open)."""
        self.closed.set()
        with self._lock:
            session, self.session = self.session, 0
        return session

    def heartbeat_once(self) -> float:
        """Heartbeat the session; returns how long to wait before the next one."""
        with self._lock:
            session, timeout = self.session, self._timeout_s
        heartbeat = self._heartbeat()
        if session and heartbeat is not None and not self.closed.is_set():
            try:
                if not heartbeat(session):
                    self.drop(session)  # timed out meanwhile: its leases are gone
            except KvtierError as exc:
                if exc.code is ErrorCode.STALE_EPOCH:
                    self.drop(session)  # restarted: the session is gone with it
                # else unreachable: try again; the store ends it if this lasts
            except ValueError:  # close() closed the channel under this call: we are done
                pass
        return max(0.05, timeout / 3) if timeout else 1.0


def _heartbeat_loop(ref: weakref.ref[OwnSession], closed: threading.Event, wait: float) -> None:
    """Heartbeat the session ``ref`` until it is closed or garbage-collected (the thread holds
    it only while it heartbeats, so a dropped client can be collected)."""
    while not closed.wait(wait):
        own = ref()
        if own is None:
            return
        wait = own.heartbeat_once()
        del own
