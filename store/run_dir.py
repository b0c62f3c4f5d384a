"""A store's run directory: the lock file that names its pool segment, and the cleanup of a
dead store's segment by the next store to start on the node.

Crash hygiene: each store holds an exclusive ``flock`` on a lock file in ``store.run_dir``
naming its segment. The kernel drops the lock when the process dies, so the next store to
start on the node finds unlocked lock files, unlinks the segments they name and removes them.
Lock files are instructions to delete files, so they are trusted only from a private place:
``run_dir`` must be owned by the store's uid and writable by nobody else (made 0700, else the
store refuses to start), only regular files owned by that uid (never symlinks) are read, and
only a /dev/shm file that is named exactly as this lock file's store names its segments
(``kvtier-<identity>-<16 hex>``) and owned by the store's uid is ever unlinked. A planted lock
file naming ``/dev/shm/victim`` or ``../x`` is logged and ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from pathlib import Path

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.client.control import socket_path
from kvtier.store.client.shm import SHM_DIR

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
SEGMENT_RE = re.compile(r"kvtier-([A-Za-z0-9_.-]+)-[0-9a-f]{16}")  # what a store names its pool


def prepare_run_dir(run_dir: Path) -> Path:
    """Create ``run_dir`` (mode 0700), or check that the existing one is private: a directory
    owned by this uid that neither group nor others may write. Its lock files tell a starting
    store which /dev/shm files to delete, so anyone who can write there could aim that at
    files of ours; refused with a clear error instead."""
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(run_dir)
    except OSError as exc:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, f"store.run_dir {run_dir}: cannot create it ({exc})"
        ) from None
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not this store's uid {uid}"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return run_dir
    raise KvtierError(
        ErrorCode.INVALID_ARGUMENT,
        f"store.run_dir {run_dir} {problem}: it holds the lock files that tell the store which "
        "shared-memory segments to delete, so it must be private to the store's user "
        f"(chmod 700 it, or set store.run_dir to a directory of uid {uid})",
    )


def acquire_lock(path: Path, segment_name: str) -> int:
    try:  # never through a symlink: O_CREAT would create or truncate its target
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, f"cannot open lock file {path}: {exc.strerror}"
        ) from None
    if not _owned_regular_file(os.fstat(fd)):
        os.close(fd)
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"lock file {path} is not a regular file owned by uid {os.geteuid()}: remove it",
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"another store with this identity is running (lock {path} held, segment "
            f"{holder[:120]})",
        ) from None
    previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if previous:  # our own identity crashed earlier and nobody cleaned up yet
        _remove_own_segment(previous, _identity(path))
    os.ftruncate(fd, 0)
    os.pwrite(fd, segment_name.encode(), 0)
    return fd


def cleanup_stale_segments(run_dir: Path) -> list[str]:
    """Remove segments of stores on this node that died without closing. Returns their names.

    Trusts only lock files that are regular files of this uid (never a symlink), and unlinks
    only a /dev/shm file of this uid named as that lock file's store names its segments; any
    other lock file is logged and left alone."""
    removed = []
    uid = os.geteuid()
    for lock_path in run_dir.glob(f"*{LOCK_SUFFIX}"):
        try:
            before = os.lstat(lock_path)
            if not _owned_regular_file(before):  # a symlink, a fifo, someone else's file
                log.warning("ignored lock file %s: not a regular file of uid %d", lock_path, uid)
                continue
            fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("ignored lock file %s: %s", lock_path, exc.strerror)
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                continue  # replaced between the check and the open: look again next start
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its store is alive
            name = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            if name and _remove_own_segment(name, _identity(lock_path)):
                removed.append(name)
                log.warning("removed pool segment %s left by a crashed store", name)
                control = socket_path(run_dir, int(name[-16:], 16))
                if control is not None and control.is_socket():
                    control.unlink()  # its control socket (run_dir is the store uid's own)
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
        finally:
            os.close(fd)
    return removed


def _identity(lock_path: Path) -> str:
    return lock_path.name[: -len(LOCK_SUFFIX)]


def _owned_regular_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _remove_own_segment(name: str, identity: str) -> bool:
    """Unlink /dev/shm/``name`` if it is a pool segment of the store ``identity`` (its lock
    file's name): named ``kvtier-<identity>-<16 hex>``, a regular file, of this uid. True if
    one was removed. Anything else a lock file names is logged and kept."""
    match = SEGMENT_RE.fullmatch(name)
    if match is None or match.group(1) != identity:
        log.warning(
            "lock file of store %s names %r, not one of its pool segments: ignored",
            identity,
            name[:120],
        )
        return False
    path = SHM_DIR / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not _owned_regular_file(st):
        log.warning("kept %s: not a regular file of uid %d", path, os.geteuid())
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True
