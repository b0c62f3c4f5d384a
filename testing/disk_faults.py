"""``kvtier store serve`` whose disk tier's file I/O fails on demand, for the disk drills
(``bench/faults/disk_drills.py``). ENOSPC, EIO and a read-only filesystem come from no disk
on demand, so they are injected: the one fake in those drills (the store, the engine, the
files and the sockets are real).

    python -m kvtier.testing.disk_faults CONTROL_FILE -- <the store's argv: python -m kvtier ...>

The store's chunk-file module (``kvtier.store.disk.files``) gets an ``os`` whose calls read
CONTROL_FILE first (a drill phase writes it, ``{"op": "write_file"}``):

    write ENOSPC | write EIO   each chunk file's data write (``pwritev``) fails so
    write EROFS                each new chunk file's creation (``open`` with ``O_CREAT``) fails,
                               as on a filesystem remounted read-only
    read EIO                   each chunk file's data read (``preadv``) fails so
    anything else, or no file  nothing fails

Nothing else in the process is touched (its own ``os`` stays the real one). The pause after a
write error other than ENOSPC (``backend.WRITE_BACKOFF_S``, 30 s) is cut to
``BACKOFF_S`` so one store shows every kind in turn within a drill.
"""

from __future__ import annotations

import errno
import os
import runpy
import sys
from pathlib import Path
from typing import Any

BACKOFF_S = 0.5


class FaultyOs:
    """The real ``os`` module but for the calls CONTROL_FILE says fail."""

    def __init__(self, control: Path) -> None:
        self._control = control

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _fault(self) -> tuple[str, int] | None:
        try:
            what, _, code = self._control.read_text().strip().partition(" ")
        except FileNotFoundError:
            return None
        number = getattr(errno, code, None)
        return (what, number) if what in ("write", "read") and number is not None else None

    def _fail(self, number: int) -> None:
        raise OSError(number, os.strerror(number))

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        fault = self._fault()
        if fault is not None and fault[0] == "write" and fault[1] != errno.EROFS:
            self._fail(fault[1])
        return os.pwritev(fd, buffers, offset)

    def open(self, path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        fault = self._fault()
        if fault == ("write", errno.EROFS) and flags & os.O_CREAT:
            self._fail(errno.EROFS)
        return os.open(path, flags, mode, **kwargs)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        fault = self._fault()
        if fault is not None and fault[0] == "read":
            self._fail(fault[1])
        return os.preadv(fd, buffers, offset)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m kvtier.testing.disk_faults CONTROL_FILE -- ARGV")
    control, command = Path(argv[0]), argv[2:]
    # the store's own argv is ``python -m kvtier <args>``: run the package's main in-process
    start = command.index("kvtier") + 1 if "kvtier" in command else len(command)
    from kvtier.store.disk import backend, files

    files.os = FaultyOs(control)  # type: ignore[assignment]
    backend.WRITE_BACKOFF_S = BACKOFF_S
    sys.argv = ["kvtier", *command[start:]]
    runpy.run_module("kvtier", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
