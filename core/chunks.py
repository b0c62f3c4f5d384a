"""The vocabulary every kvtier package shares about chunks: which medium holds one, what a
lookup found, where its bytes are.

Media in order of preference: vLLM's own GPU memory (indexed, never owned by kvtier), the
node's shared DRAM pool, other nodes' pools (remote), and later local disk.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# (offset, length) in bytes from the start of a pool segment.
Extent = tuple[int, int]


def extent_pieces(extents: Sequence[Extent], start: int, length: int) -> Iterator[Extent]:
    """The segment (offset, length) pieces holding bytes ``[start, start + length)`` of a
    chunk stored in ``extents`` (the allocator may split a chunk into several)."""
    pos = 0
    for offset, size in extents:
        lo, hi = max(start, pos), min(start + length, pos + size)
        if lo < hi:
            yield offset + lo - pos, hi - lo
        pos += size
        if pos >= start + length:
            return


class Tier(enum.StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    REMOTE = "remote"
    DISK = "disk"


class LookupStatus(enum.StrEnum):
    """Per-chunk outcome of a lookup; a prefix lookup reports the status that ended it."""

    HIT = "hit"  # committed and (if asked) leased
    MISS = "miss"  # not held
    PENDING = "pending"  # being written right now: ask again soon rather than recompute


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a chunk's bytes are in a pool segment."""

    key: bytes
    size: int
    extents: tuple[Extent, ...]  # (byte offset, length) in the segment, in order
    checksum: int  # XXH3-64 of the chunk's bytes, 0 while being written


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """The pool segment one store incarnation (epoch) hands out extents of: a store restart
    makes a new segment, and extents of one incarnation mean nothing in another's."""

    name: str
    size: int
    epoch: int
