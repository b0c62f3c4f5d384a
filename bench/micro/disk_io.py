"""The disk tier's file I/O beside the filesystem's floor, and O_DIRECT beside the page-cache
path the tier uses (docs/disk.md):

    kvtier bench disk-io [--dir PATH] [--chunk 8MiB] [--chunks 32] [--repeat 3]

Each round writes ``chunks`` chunk files of ``chunk`` bytes into a fresh directory under
``--dir`` (put it on the disk tier's filesystem) and reads them back, three ways, interleaved:

- ``kvtier``: exactly the tier's calls, ``files.write_chunk`` (pwritev, fsync, drop the page
  cache, rename) per file and ``fsync_dirs``, then ``files.read_chunk_into`` (header check,
  preadv, drop the page cache, XXH3 of the data);
- ``O_DIRECT``: the same files written and read with ``O_DIRECT`` from page-aligned buffers
  (fsync, rename and the checksum too, so only the I/O path differs);
- ``segments``: what segment files would give (docs/disk.md asked to measure it before
  building it): the same header-and-data records packed into files of ``--segment`` bytes,
  one fsync and one rename per segment instead of per chunk; each chunk read with its header
  check, the page cache dropped and its checksum, through one open per segment;
- the floor: one file of all the bytes, one write and fsync, then one read with the page
  cache dropped (``dd``-style sequential I/O).

GB/s per path, median and best over ``repeat`` rounds. Reads are of files whose pages were
dropped from the cache, as a stage finds them after a spill.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.store.client.shm import checksum_views, page_aligned_empty
from kvtier.store.disk import files
from kvtier.store.disk.files import HEADER_BYTES, ChunkHeader, chunk_path, encode_header

PATHS = ("kvtier", "O_DIRECT", "segments", "floor")


@dataclass
class DiskIoReport:
    directory: str
    chunk_bytes: int
    chunks: int
    repeat: int
    segment_bytes: int
    # path -> [seconds per round]
    write_s: dict[str, list[float]] = field(default_factory=dict)
    read_s: dict[str, list[float]] = field(default_factory=dict)

    def gbps(self, seconds: list[float]) -> tuple[float, float]:
        """(median, best) GB/s of ``seconds`` for this round's bytes."""
        total = self.chunk_bytes * self.chunks
        return total / statistics.median(seconds) / 1e9, total / min(seconds) / 1e9


def run(
    directory: Path, chunk_bytes: int, chunks: int, repeat: int, segment_bytes: int = 64 << 20
) -> DiskIoReport:
    if chunk_bytes % 4096:
        raise ValueError("--chunk must be a multiple of 4 KiB (O_DIRECT's unit)")
    report = DiskIoReport(str(directory), chunk_bytes, chunks, repeat, segment_bytes)
    data = [page_aligned_empty(chunk_bytes) for _ in range(chunks)]
    rng = np.random.default_rng(0)
    for buf in data:
        buf[:] = rng.integers(0, 256, chunk_bytes, np.uint8)
    into = [page_aligned_empty(chunk_bytes) for _ in range(chunks)]
    directory.mkdir(parents=True, exist_ok=True)
    for round_ in range(repeat):
        # interleaved, the order rotating, so no path always runs on a warmer disk
        turn = round_ % len(PATHS)
        for path in PATHS[turn:] + PATHS[:turn]:
            root = Path(tempfile.mkdtemp(prefix=f"disk-io-{path}-", dir=directory))
            try:
                if path == "segments":
                    write_s, read_s = _segments(root, data, into, segment_bytes)
                else:
                    write_s, read_s = _ROUND[path](root, data, into)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            report.write_s.setdefault(path, []).append(write_s)
            report.read_s.setdefault(path, []).append(read_s)
    return report


def _headers(data: list[np.ndarray]) -> list[ChunkHeader]:
    return [
        ChunkHeader(b"n" * 16, i.to_bytes(16, "big"), buf.nbytes, checksum_views([buf]))
        for i, buf in enumerate(data)
    ]


def _kvtier(root: Path, data: list[np.ndarray], into: list[np.ndarray]) -> tuple[float, float]:
    headers = _headers(data)
    paths = [chunk_path(root, h.ns_id, h.key) for h in headers]
    start = time.perf_counter()
    for path, header, buf in zip(paths, headers, data, strict=True):
        files.write_chunk(path, header, [buf])
    files.fsync_dirs({p.parent for p in paths} | {p.parent.parent for p in paths} | {root})
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    for path, header, buf in zip(paths, headers, into, strict=True):
        files.read_chunk_into(path, header, [buf])
    return wrote, time.perf_counter() - start


def _direct(root: Path, data: list[np.ndarray], into: list[np.ndarray]) -> tuple[float, float]:
    import xxhash

    headers = _headers(data)
    paths = [chunk_path(root, h.ns_id, h.key) for h in headers]
    head = page_aligned_empty(HEADER_BYTES)
    start = time.perf_counter()
    for path, header, buf in zip(paths, headers, data, strict=True):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + files.TMP_MARK + "direct")
        head[:] = np.frombuffer(encode_header(header), np.uint8)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [head.data, buf.data], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    files.fsync_dirs({p.parent for p in paths} | {p.parent.parent for p in paths} | {root})
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    for path, buf in zip(paths, into, strict=True):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [head.data], 0)
            files.decode_header(head.tobytes())
            os.preadv(fd, [buf.data], HEADER_BYTES)
        finally:
            os.close(fd)
        xxhash.xxh3_64_intdigest(buf.data)
    return wrote, time.perf_counter() - start


def _segments(
    root: Path, data: list[np.ndarray], into: list[np.ndarray], segment_bytes: int
) -> tuple[float, float]:
    headers = _headers(data)
    record = HEADER_BYTES + data[0].nbytes
    per_segment = max(1, segment_bytes // record)
    groups = [range(i, min(i + per_segment, len(data))) for i in range(0, len(data), per_segment)]
    paths = [root / f"segment-{n:06d}" for n in range(len(groups))]
    start = time.perf_counter()
    for path, group in zip(paths, groups, strict=True):
        tmp = path.with_name(path.name + files.TMP_MARK + "segment")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for slot, i in enumerate(group):
                head = encode_header(headers[i])
                os.pwritev(fd, [head, data[i].data], slot * record)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    files.fsync_dirs({root})
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    for path, group in zip(paths, groups, strict=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            for slot, i in enumerate(group):
                offset = slot * record
                header = files.decode_header(os.pread(fd, HEADER_BYTES, offset))
                os.preadv(fd, [into[i].data], offset + HEADER_BYTES)
                os.posix_fadvise(fd, offset, record, os.POSIX_FADV_DONTNEED)
                if checksum_views([into[i]]) != header.checksum:
                    raise files.BadChunkFile("segment record does not match its checksum")
        finally:
            os.close(fd)
    return wrote, time.perf_counter() - start


def _floor(root: Path, data: list[np.ndarray], into: list[np.ndarray]) -> tuple[float, float]:
    path = root / "floor.bin"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwritev(fd, [buf.data for buf in data], 0)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    wrote = time.perf_counter() - start
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [buf.data for buf in into], 0)
    finally:
        os.close(fd)
    return wrote, time.perf_counter() - start


_ROUND = {"kvtier": _kvtier, "O_DIRECT": _direct, "floor": _floor}


def format_report(report: DiskIoReport) -> str:
    total = report.chunk_bytes * report.chunks
    lines = [
        f"disk-io: {report.chunks} files of {report.chunk_bytes >> 10} KiB "
        f"({total >> 20} MiB a round), {report.repeat} rounds, in {report.directory}; "
        f"segments of {report.segment_bytes >> 20} MiB",
        f"{'path':<10} {'write GB/s med (best)':>22} {'read GB/s med (best)':>22}",
    ]
    for path in PATHS:
        w_med, w_best = report.gbps(report.write_s[path])
        r_med, r_best = report.gbps(report.read_s[path])
        lines.append(f"{path:<10} {w_med:>14.2f} ({w_best:5.2f}) {r_med:>14.2f} ({r_best:5.2f})")
    return "\n".join(lines)
