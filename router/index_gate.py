"""The index on a routing decision's hot path, with a deadline.

An index that stops answering (a frozen process, a partition that drops packets) must not
add its RPC timeout (10 s) to every request: past ``router.index_timeout_s`` the decision
goes on without it (routing by load, the policies' behaviour when nothing is known to be
cached), the miss is counted, and ``/readyz`` says ``index: degraded``.

How: calls run on threads of their own and the caller waits at most the deadline. A call
past its deadline is left to finish (or hit the index client's own timeout) on its thread;
while ``LATE_SLOTS`` calls are so late, decisions skip the index at once rather than pile
more calls onto it, so a frozen index costs a request nothing beyond the first few
deadlines. A late answer is not lost where it is worth keeping (``on_late``: the namespace
list). Calls that answer in time are not limited beyond the pool (``WORKERS``).

Threading: ``call`` may run on any number of threads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

LATE_SLOTS = 4  # calls past their deadline and not yet ended; at this many the index is skipped
WORKERS = 32  # threads for index calls (what the router's decisions run on at most at once)


class IndexGate:
    def __init__(
        self,
        timeout_s: float | None,
        on_degraded: Callable[[str], None] | None = None,
    ) -> None:
        """``timeout_s`` None: no deadline, calls run on the caller's thread (an embedded
        index, benchmarks). ``on_degraded(reason)``: a call missed (timeout, busy, error)."""
        self.timeout_s = timeout_s
        self.on_degraded = on_degraded
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="kvtier-index")
            if timeout_s is not None
            else None
        )
        self._lock = threading.Lock()
        self._late = 0  # calls past their deadline, still running
        self._degraded: str | None = None  # why the last call missed; None: it answered
        self._since = time.monotonic()

    def call(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        on_late: Callable[[T], None] | None = None,
    ) -> T | None:
        """``fn(*args)``'s answer, or None when the index did not give one in time (or
        failed). ``on_late``: called with an answer that arrives after the deadline."""
        if self._pool is None:
            try:
                result = fn(*args)
            except Exception as exc:
                self._missed("error", f"{what} failed: {exc}")
                return None
            self._answered()
            return result
        with self._lock:
            late = self._late
        if late >= LATE_SLOTS:
            self._missed("busy", f"{what}: {late} index calls still past their deadline")
            return None
        future = self._pool.submit(fn, *args)
        try:
            result = future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            if not future.cancel():  # started: it holds a late slot until it ends
                with self._lock:
                    self._late += 1
                future.add_done_callback(lambda f: self._ended_late(f, on_late))
            ms = (self.timeout_s or 0) * 1e3
            self._missed("timeout", f"{what} not answered in {ms:g} ms")
            return None
        except Exception as exc:  # an index outage makes routing load-only, never an error
            self._missed("error", f"{what} failed: {exc}")
            return None
        self._answered()
        return result

    def _ended_late(
        self, future: concurrent.futures.Future[T], on_late: Callable[[T], None] | None
    ) -> None:
        with self._lock:
            self._late -= 1
        if on_late is None or future.cancelled() or future.exception() is not None:
            return
        try:
            on_late(future.result())
        except Exception:  # a callback's failure must not reach the pool's thread
            log.exception("router: using a late index answer failed")

    def _missed(self, reason: str, detail: str) -> None:
        with self._lock:
            was = self._degraded
            self._degraded = detail
            if was is None:
                self._since = time.monotonic()
        if was is None:
            log.warning("router: index degraded, routing by load: %s", detail)
        if self.on_degraded is not None:
            self.on_degraded(reason)

    def _answered(self) -> None:
        with self._lock:
            was = self._degraded
            self._degraded = None
            if was is not None:
                self._since = time.monotonic()
        if was is not None:
            log.warning("router: index answers again")

    def state(self) -> dict[str, Any]:
        """For ``/readyz``: ``index`` ok | degraded, why, and for how long."""
        with self._lock:
            degraded, since = self._degraded, self._since
        if degraded is None:
            return {"index": "ok"}
        return {
            "index": "degraded",
            "index_reason": degraded,
            "index_degraded_s": round(time.monotonic() - since, 1),
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
