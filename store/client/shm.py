"""The DRAM pool's memory: one POSIX shared-memory segment per store, mapped by every process.

The store creates the segment (``SharedSegment.create``) and is the only process that unlinks
it; vLLM workers and other clients ``attach`` by name and copy chunk bytes in and out directly,
so no KV crosses a socket inside a node. Which bytes belong to which chunk is decided by the
store's allocator; this module only moves bytes between extents of the segment and buffers.

Threading: copies are plain memcpys on disjoint extents and may run from any thread; the
store's leases guarantee nobody reuses an extent while a copy into or out of it is running.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvtier.core.chunks import Extent, SegmentRef

SHM_DIR = Path("/dev/shm")


class SegmentError(RuntimeError):
    pass


@dataclass
class SharedSegment:
    """A mapped shared-memory segment. ``array`` is a uint8 numpy view of all of it."""

    name: str
    size: int
    owner: bool
    _mmap: mmap.mmap
    array: np.ndarray
    identity: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file mapped

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True) -> SharedSegment:
        """Create (exclusively) and map a new segment of ``size`` bytes.

        The memory is reserved with ``posix_fallocate`` so a full /dev/shm is a clear error
        here rather than a SIGBUS in some client's memcpy later.
        """
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            if prefault:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise SegmentError(
                        f"cannot reserve {size} bytes in {SHM_DIR} for the pool ({exc}); "
                        "lower store.pool.capacity or enlarge /dev/shm"
                    ) from exc
            seg = cls._map(name, fd, size, owner=True, populate=prefault)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return seg

    @classmethod
    def attach(cls, name: str, size: int, populate: bool = True) -> SharedSegment:
        """Map an existing segment created by a store. ``size`` must match the store's."""
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise SegmentError(f"pool segment {name!r} does not exist (store gone?)") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise SegmentError(f"pool segment {name!r} is {actual} bytes, expected {size}")
            seg = cls._map(name, fd, size, owner=False, populate=populate)
        finally:
            os.close(fd)
        return seg

    @classmethod
    def _map(cls, name: str, fd: int, size: int, owner: bool, populate: bool) -> SharedSegment:
        flags = mmap.MAP_SHARED
        if populate:
            # Fill the page tables now: otherwise the first copy into each 4 KiB page pays a
            # minor fault, which costs as much as the memcpy itself.
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        array = np.frombuffer(mapped, dtype=np.uint8)
        st = os.fstat(fd)
        return cls(name, size, owner, mapped, array, (st.st_dev, st.st_ino))

    # -- data movement -------------------------------------------------------------------

    def write(
        self, extents: Sequence[Extent], src: np.ndarray | bytes | bytearray | memoryview
    ) -> None:
        """Copy ``src`` (exactly the extents' total length) into the extents, in order."""
        flat = _as_u8(src)
        total = sum(length for _, length in extents)
        if flat.size != total:
            raise ValueError(f"source is {flat.size} bytes, extents hold {total}")
        pos = 0
        for offset, length in extents:
            self._check(offset, length)
            self.array[offset : offset + length] = flat[pos : pos + length]
            pos += length

    def read_into(self, extents: Sequence[Extent], dst: np.ndarray | bytearray) -> None:
        """Copy the extents, in order, into ``dst`` (exactly their total length)."""
        flat = _as_u8(dst)
        total = sum(length for _, length in extents)
        if flat.size != total:
            raise ValueError(f"destination is {flat.size} bytes, extents hold {total}")
        pos = 0
        for offset, length in extents:
            self._check(offset, length)
            flat[pos : pos + length] = self.array[offset : offset + length]
            pos += length

    def read(self, extents: Sequence[Extent]) -> bytes:
        out = np.empty(sum(length for _, length in extents), dtype=np.uint8)
        self.read_into(extents, out)
        return out.tobytes()

    def views(self, extents: Sequence[Extent]) -> list[np.ndarray]:
        """Zero-copy views of the extents (valid while the segment is mapped and leased)."""
        for offset, length in extents:
            self._check(offset, length)
        return [self.array[offset : offset + length] for offset, length in extents]

    @property
    def base_address(self) -> int:
        """Virtual address of the mapping (for registering it with a transfer engine)."""
        return int(self.array.ctypes.data)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"extent ({offset}, {length}) outside the {self.size}-byte pool")

    # -- lifetime --------------------------------------------------------------------------

    def is_live(self) -> bool:
        """Is this mapping still the segment its store serves? A store that stopped, crashed
        or restarted has its segment unlinked (by itself, its watchdog, or the next store), so
        a mapping whose file is gone or replaced holds an incarnation nobody leases from."""
        try:
            st = os.stat(f"{SHM_DIR}/{self.name}")  # a str, not a Path: this runs per step
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def close(self) -> None:
        """Unmap. Views handed out earlier must not be used afterwards."""
        self.array = np.empty(0, dtype=np.uint8)
        # If someone still holds a view (e.g. a torch tensor over the pool), the mapping is
        # freed when the last view goes away.
        with contextlib.suppress(BufferError):
            self._mmap.close()

    @property
    def unmapped(self) -> bool:
        """``close`` unmapped it (False while a view handed out earlier still holds it)."""
        return self._mmap.closed

    def unlink(self) -> None:
        _unlink_quietly(_path(self.name))


def map_segment(ref: SegmentRef) -> SharedSegment:
    """Map the pool segment of one store incarnation (a worker copies through it). Raises
    RuntimeError when it is gone (the store stopped or restarted)."""
    try:
        return SharedSegment.attach(ref.name, ref.size)
    except SegmentError as exc:
        raise RuntimeError(f"cannot map pool segment {ref.name}: {exc}") from exc


def page_aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned private uint8 buffer, touched (no page faults later).

    Alignment matters for copies out of the pool: with glibc's memcpy, a destination 16 bytes
    past a page boundary (where a plain ``np.empty`` lands) while the source is page-aligned
    triggers 4K aliasing and copies 64-256 KiB blocks ~3x slower. Torch's large KV tensors
    and this helper are page-aligned.
    """
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(buf, dtype=np.uint8)[:nbytes]
    array.fill(1)
    return array


def _as_u8(buf: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid segment name {name!r}")
    return SHM_DIR / name


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def segment_exists(name: str) -> bool:
    return _path(name).exists()


def remove_segment(name: str) -> bool:
    """Remove a segment left behind by a crashed store. True if one was there."""
    path = _path(name)
    existed = path.exists()
    _unlink_quietly(path)
    return existed


def checksum_views(views: Sequence[np.ndarray]) -> int:
    """A chunk's checksum: XXH3-64 of its bytes (the concatenation of ``views``), with 0
    mapped to 1 because 0 means "not computed yet" in the store's metadata."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0].data) or 1
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view.data)
    return h.intdigest() or 1
