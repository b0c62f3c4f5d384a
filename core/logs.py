"""Logging set-up shared by every kvtier command, and ``Throttled``: a log line per cause, not
per request, for what callers control."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: kvtier.core.rpc imports this module, and needs no config
    from kvtier.core.config import KvtierConfig


def setup_logging(config: KvtierConfig) -> None:
    """Log to stderr at ``config.log_level`` (stdout carries the commands' JSON lines)."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def console() -> Any:
    """A rich ``Console`` that prints tables whole: the terminal's width on a terminal; piped
    or logged, wide enough for any of ours (rich would otherwise cut them to 80 columns)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=250)


class Throttled:
    """Logs a warning at most once per ``key`` per ``interval_s`` and says, the next time,
    how many it held back. For what a caller decides (malformed requests, say): one line per
    request would let anyone fill the disk and drown every other line. Thread-safe."""

    MAX_KEYS = 1024  # keys are causes (method, error type), few; forget them all past this

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (logged at, held back)

    def warning(self, key: Hashable, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            logged_at, held = self._seen.get(key, (None, 0))
            if logged_at is not None and now - logged_at < self._interval_s:
                self._seen[key] = (logged_at, held + 1)
                return
            if len(self._seen) >= self.MAX_KEYS:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            message += f" ({held} more like it since the last such line)"
        self._logger.warning(message, *args)
