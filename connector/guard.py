"""Containment of connector failures: an error in a vLLM hook costs that request its hit, never
the engine.

vLLM calls the connector inside its scheduler and model-runner loops; an exception there kills
EngineCore. Every hook catches what escapes it, counts it, makes the request a miss (or its
load a load error, so vLLM recomputes) and logs it with a traceback once per cause (hook and
exception type), then quietly: a store that is down would otherwise log every request.

Threading: ``record`` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvtier.connector")


class HookGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()
        self.errors = 0

    def record(self, hook: str, exc: BaseException) -> None:
        cause = (hook, type(exc).__name__)
        with self._lock:
            self.errors += 1
            first = cause not in self._seen
            self._seen.add(cause)
        if first:
            log.error(
                "kvtier: %s failed (%r); the request is served without kvtier. Further %s "
                "errors in this hook are logged at debug level.",
                hook,
                exc,
                cause[1],
                exc_info=exc,
            )
        else:
            log.debug("kvtier: %s failed again: %r", hook, exc)
