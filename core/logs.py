"""Logging set-up shared by every kvtier command."""

from __future__ import annotations

import logging
import sys
from typing import Any

from kvtier.config import KvtierConfig


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
