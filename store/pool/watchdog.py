"""The pool segment's watchdog: a tiny process, outside the store's process tree, that unlinks
the segment and lock file when the store dies without closing."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


# A tiny process that outlives this one: when the store's process dies without closing (SIGKILL,
# an engine killed by its supervisor), the pipe to it reaches EOF and it removes the pool segment
# and lock file at once, instead of leaving gigabytes of /dev/shm until the next store starts
# on the node. A byte on the pipe means "closed cleanly, touch nothing" (a new store may already
# use the lock file's name).
#
# It must not be a descendant of the store's process: supervisors kill whole process trees, not
# only process groups (vLLM's shutdown SIGKILLs every descendant of its engine process, the
# embedded store's watchdog included, which left a 1 GiB segment per engine). So the launcher
# forks the watchdog and exits: the watchdog is re-parented to init (or the nearest subreaper)
# and holds the pipe's read end; a new session keeps it out of the store's process group too.
_WATCHDOG = (
    "import os, sys\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "if not sys.stdin.buffer.read():\n"
    "    for path in sys.argv[1:]:\n"
    "        try:\n"
    "            os.unlink(path)\n"
    "        except OSError:\n"
    "            pass\n"
)


def start_watchdog(paths: list[Path]) -> subprocess.Popen | None:
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG, *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of this process's group as well as its tree
        )
        launcher.wait(10)  # it exits once the watchdog is forked; reaped here, no zombie
    except (
        OSError,
        subprocess.TimeoutExpired,
    ) as exc:  # the next start's cleanup still covers a crash
        log.warning("no segment watchdog (%s)", exc)
        return None
    return launcher  # its stdin is the pipe the watchdog reads


def stop_watchdog(watchdog: subprocess.Popen | None) -> None:
    if watchdog is None or watchdog.stdin is None:
        return
    with contextlib.suppress(OSError):
        watchdog.stdin.write(b"closed")
        watchdog.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watchdog.wait(5)
