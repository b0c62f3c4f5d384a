"""One chunk file on the node's disk: its format, how it is written so it is never seen half
done, and how it is read back and checked.

A chunk file is a 4 KiB header and the chunk's bytes::

    magic "KVTDISK1" | version u32 | ns_len u16 | key_len u16 | salt_len u16 | size u64
    | checksum u64 | header checksum u64 | ns_id | key | salt | zero padding to 4096
    | size bytes of data

``salt`` is the namespace's ``cache_salt`` digest (``kvtier.core.keys.salt_digest``, '' when
unsalted, never the salt): which tenant the file counts against, known again after a restart
before any engine has registered the namespace.

``checksum`` is the pool's (XXH3-64 of the data, 0 mapped to 1: ``checksum_views``), so a
chunk staged back into the pool is committed with the checksum its loads verify. The header
has its own checksum so a torn or corrupted header is told from a valid one without reading
the data. Data starts on a 4 KiB boundary (the unit of O_DIRECT and of most SSDs' pages).

Writing (``write_chunk``): the bytes go to ``<final>.tmp-<pid>-<n>`` (created exclusively,
0600), are fsynced, and the file is renamed to its final name; the caller fsyncs each
directory it renamed into (``fsync_dirs``) before it treats the chunk as on disk. A crash at
any point leaves either no final file, or a final file whose data and checksum were durable
before its name was. Leftover ``.tmp-`` files are removed by the next scan.

Reading (``read_chunk_into``): the header is checked against what the caller expects (the
namespace, the key, the size), the data is read straight into the caller's buffers (pool
pages) with ``preadv``, and its checksum is recomputed over those buffers. Anything else (a
short file, a wrong header, bytes that do not match) is ``BadChunkFile``; an OS error is
raised as is. The caller drops the file in both cases: a miss, never a wrong token.

Page cache: each file is written and read once per trip between DRAM and disk, and its bytes
then live in the pool, so the kernel is told not to keep them (``POSIX_FADV_DONTNEED``);
O_DIRECT reads 1 MiB files no faster and 8 MiB files 21 % slower (no readahead), writes
12-19 % faster off the request path: buffered it stays (``kvtier bench disk-io``, docs/disk.md).
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"KVTDISK1"
VERSION = 2  # 1: no salt (its files are removed by the next scan)
HEADER_BYTES = 4096
_FIELDS = struct.Struct("<8sIHHHQQ")  # magic, version, ns/key/salt lengths, size, checksum
_HEADER_SUM = struct.Struct("<Q")
TMP_MARK = ".tmp-"
_tmp_counter = itertools.count()
# buffers one writev/preadv takes (a chunk the pool split into more pieces goes in several)
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)


class BadChunkFile(ValueError):
    """The file is not the chunk it should be (torn, truncated, corrupted or foreign)."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    ns_id: bytes
    key: bytes
    size: int
    checksum: int
    salt: str = ""  # the namespace's cache_salt digest: its tenant


def chunk_path(root: Path, ns_id: bytes, key: bytes) -> Path:
    """Where a chunk's file lives: one directory per namespace, 256 fan-out directories."""
    hex_key = key.hex()
    return root / ns_id.hex() / hex_key[:2] / hex_key


def encode_header(header: ChunkHeader) -> bytes:
    salt = header.salt.encode()
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        len(header.ns_id),
        len(header.key),
        len(salt),
        header.size,
        header.checksum,
    )
    body = fields + header.ns_id + header.key + salt
    out = (
        body[: _FIELDS.size]
        + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))
        + body[_FIELDS.size :]
    )
    if len(out) > HEADER_BYTES:
        raise ValueError(f"namespace id and key too long for a chunk header: {len(out)} bytes")
    return out.ljust(HEADER_BYTES, b"\0")


def decode_header(raw: bytes) -> ChunkHeader:
    """The header at the start of ``raw`` (BadChunkFile if it is not a valid one)."""
    fixed = _FIELDS.size + _HEADER_SUM.size
    if len(raw) < fixed:
        raise BadChunkFile(f"header cut short at {len(raw)} bytes")
    magic, version, ns_len, key_len, salt_len, size, checksum = _FIELDS.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise BadChunkFile(f"not a kvtier chunk file (magic {magic!r}, version {version})")
    end = fixed + ns_len + key_len + salt_len
    if end > min(len(raw), HEADER_BYTES):
        raise BadChunkFile("header cut short")
    (stored_sum,) = _HEADER_SUM.unpack_from(raw, _FIELDS.size)
    names = raw[fixed:end]
    if xxhash.xxh3_64_intdigest(raw[: _FIELDS.size] + names) != stored_sum:
        raise BadChunkFile("header checksum does not match")
    ns_id, key = names[:ns_len], names[ns_len : ns_len + key_len]
    try:
        salt = names[ns_len + key_len :].decode()
    except UnicodeDecodeError as exc:
        raise BadChunkFile("header salt is not text") from exc
    return ChunkHeader(ns_id, key, size, checksum, salt)


def read_header(path: Path) -> ChunkHeader:
    """The header of the file at ``path``, checked against the file's length."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
        length = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if length != HEADER_BYTES + header.size:
        raise BadChunkFile(f"file is {length} bytes, its header says {HEADER_BYTES + header.size}")
    return header


def write_chunk(
    path: Path, header: ChunkHeader, data: Sequence[np.ndarray], fsync: bool = True
) -> int:
    """Write a chunk file (header, then ``data``'s bytes in order) and rename it into place.
    Returns the file's size. On any error nothing is left under ``path`` or beside it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{next(_tmp_counter)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        buffers: list[memoryview] = [memoryview(encode_header(header))]
        buffers += [view.data.cast("B") for view in data]
        expected = HEADER_BYTES + header.size
        written = 0
        while written < expected:  # several calls: more than IOV_MAX pieces, or short writes
            written += os.pwritev(fd, _tail(buffers, written)[:IOV_MAX], written)
        if fsync:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return expected


def fsync_dirs(dirs: set[Path]) -> None:
    """Make renames into ``dirs`` (and the directories themselves) durable."""
    for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_chunk_into(path: Path, expected: ChunkHeader, into: Sequence[np.ndarray]) -> int:
    """Read the chunk file at ``path`` into ``into`` (buffers of ``expected.size`` bytes in
    all) and verify it. Returns its checksum. BadChunkFile: not this chunk or not intact."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
        if (header.ns_id, header.key, header.size) != (
            expected.ns_id,
            expected.key,
            expected.size,
        ):
            raise BadChunkFile("file holds another chunk than its name says")
        views = [view.data.cast("B") for view in into]
        done, offset = 0, HEADER_BYTES
        while done < header.size:
            got = os.preadv(fd, _tail(views, done)[:IOV_MAX], offset + done)
            if got == 0:
                raise BadChunkFile(f"file ends after {done} of {header.size} data bytes")
            done += got
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    hasher = xxhash.xxh3_64()
    for view in into:
        hasher.update(view.data)
    checksum = hasher.intdigest() or 1
    if checksum != header.checksum or checksum != expected.checksum:
        raise BadChunkFile("data does not match its checksum")
    return checksum


def _tail(views: list[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out = []
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        out.append(view[skip:])
        skip = 0
    return out
