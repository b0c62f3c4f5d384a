"""The scheduler side's lookups in flight: how many may run at once, and how long a step waits.

vLLM's scheduler asks ``get_num_new_matched_tokens`` for every waiting request, every step, on
its one thread; a lookup that needs the node store (a socket round trip, or a remote tier's
index query: tens of ms on a loaded machine) runs on a ``kvtier-lookup`` thread instead, and
the hook answers "ask again" (``None``) until it is done. Three rules keep that from costing
the requests beside it:

- **A step's budget**: every lookup waited for in one step shares ``lookup_wait_s`` (what a
  node-local lookup takes, to save the request a step), reset when the step ends.
- **One wait per lookup while others run**: a lookup still running after its first wait is
  only looked at in later steps, never waited for, while the last step computed anything; an
  engine with nothing running waits each step (it would only spin), and that idle wait is
  not the engine's cost (``idle_wait_s``, left out of the connector's hook time).
- **Admission**: at most ``max_pending_lookups`` in flight; past it a request is not looked
  up (counted as shed) and computes its prefix.

A lookup still running at ``lookup_deadline_s`` is given up (the request recomputes); one
superseded (its request's inputs changed, or it finished) is forgotten, and whatever it
leased is released when it completes.

Threading: every method runs on vLLM's scheduler thread, except the done callbacks, which run
on whichever thread completed the lookup (hence the lock around the in-flight count).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Literal

from kvtier.connector.counters import C, Counter
from kvtier.connector.request_state import LookupOutcome, RequestState
from kvtier.core.config.connector import ConnectorConfig

log = logging.getLogger(__name__)

# what ``LookupWaits.wait`` answers when it has no outcome: still running (ask again next
# step), or run past its deadline (answer "no hit" for this local hit from now on)
Unresolved = Literal["pending", "gave_up"]


class LookupWaits:
    def __init__(
        self,
        config: ConnectorConfig,
        chunk_tokens: int,
        executor: Executor,
        release: Callable[[LookupOutcome], None],
        count: Callable[[Counter, float], None],
    ) -> None:
        """``executor`` runs the lookups (inline for an embedded store; a test may swap it for
        threads, as a served store has); ``release`` gives back the leases of a lookup nobody
        will use."""
        self.config = config
        self._chunk_tokens = chunk_tokens
        self.executor = executor
        self._release = release
        self._count = count
        self._wait_left = config.lookup_wait_s  # what is left of this step's budget
        self._running = 0  # requests the last step computed
        # seconds waited for lookups while nothing else ran (the engine's loop would have spun)
        self.idle_wait_s = 0.0
        self._in_flight = 0  # submitted and not done
        self._in_flight_lock = threading.Lock()

    def new_step(self, running: int) -> None:
        """A step ended, computing ``running`` requests: the next step's budget, and what its
        lookups would hold up."""
        self._wait_left = self.config.lookup_wait_s
        self._running = running

    def start(
        self,
        state: RequestState,
        computed: int,
        resolve: Callable[[RequestState, int], LookupOutcome],
    ) -> bool:
        """Look ``state`` up past vLLM's local hit ``computed``; False (nothing started) when
        ``max_pending_lookups`` are already in flight."""
        with self._in_flight_lock:
            if self._in_flight >= self.config.max_pending_lookups:
                return False
            self._in_flight += 1
        state.lookup_for = computed
        state.lookup_waited = False
        state.lookup_deadline = time.monotonic() + self.config.lookup_deadline_s
        state.lookup = self.executor.submit(resolve, state, computed)
        state.lookup.add_done_callback(self._done)
        return True

    def wait(self, state: RequestState, req_id: str) -> LookupOutcome | Unresolved:
        """The outcome of ``state``'s lookup in flight, waiting for it as the rules above allow.
        A lookup that raised is a miss (counted): the request computes its prefix."""
        assert state.lookup is not None
        busy = self._running > 0
        wait = 0.0 if state.lookup_waited and busy else max(0.0, self._wait_left)
        state.lookup_waited = True
        waited_from = time.monotonic()
        try:
            outcome = state.lookup.result(timeout=wait)
        except FutureTimeout:
            if time.monotonic() < state.lookup_deadline:
                self._count(C.LOOKUPS_PENDING, 1)
                return "pending"
            self._count(C.LOOKUP_DEADLINE_MISSES, 1)
            log.warning("kvtier: lookup for %s past its deadline: recompute", req_id)
            self.supersede(state)
            return "gave_up"
        except Exception as exc:
            log.warning("kvtier lookup failed for %s: %r", req_id, exc)
            self._count(C.LOOKUP_ERRORS, 1)
            computed = state.lookup_for
            outcome = LookupOutcome(computed, computed // self._chunk_tokens)
        finally:
            waited = time.monotonic() - waited_from
            self._wait_left -= waited
            self._count(C.LOOKUP_WAIT_SECONDS, waited)
            if not busy:  # held nothing up: the engine had nothing else to run
                self.idle_wait_s += waited
        state.lookup = None
        return outcome

    def supersede(self, state: RequestState) -> None:
        """Forget ``state``'s lookup in flight; whatever it leases is released when it
        completes."""
        if state.lookup is not None:
            state.lookup.add_done_callback(self._release_result)
            state.lookup = None

    def _done(self, _: Future[LookupOutcome]) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

    def _release_result(self, future: Future[LookupOutcome]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._release(future.result())

    def shutdown(self) -> None:
        """Stop the lookup threads; lookups not started are cancelled."""
        self.executor.shutdown(wait=True, cancel_futures=True)
