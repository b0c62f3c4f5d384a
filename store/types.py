"""Values the store's state machine hands out and keeps: states, statuses, entries, results.

Kept apart from ``core.py`` (the state machine) so clients, the wire codec and the remote tier
import them without the machinery.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import KEY_BYTES, Namespace
from kvtier.tiers.base import ChunkLocation, LookupStatus
from kvtier.tiers.cpu.allocator import PageRun

COUNTERS = (
    "lookups",
    "hit_chunks",
    "miss_chunks",
    "pending_lookups",
    "allocated",
    "exists",
    "in_progress",
    "no_space",
    "commits",
    "aborts",
    "evictions",
    "deletes",
    "clears",
    "released_read",
    "released_write",
    "expired_read",
    "expired_write",
    "quarantined",
    "quarantine_released",
)


class ChunkState(enum.StrEnum):
    WRITING = "writing"
    COMMITTED = "committed"


class AllocStatus(enum.StrEnum):
    ALLOCATED = "allocated"  # write the bytes, then commit
    EXISTS = "exists"  # already stored: nothing to write (idempotent put)
    IN_PROGRESS = "in_progress"  # another writer is storing it right now
    NO_SPACE = "no_space"  # the pool is full of pinned / being-written chunks


@dataclass(slots=True, eq=False)
class ChunkEntry:
    key: bytes
    namespace: bytes
    size: int
    runs: list[PageRun]
    pages: int
    state: ChunkState
    pins: int = 0
    checksum: int = 0  # XXH3-64 of the bytes; 0 = not computed yet (the store fills it in)
    last_access: float = 0.0
    doomed: bool = False  # unlinked from the table; pages freed once nothing references it


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    ns_id: bytes
    chunk_bytes: int
    namespace: Namespace


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: list[ChunkLocation]  # the longest committed prefix of the keys asked
    stop: LookupStatus  # HIT when every key hit, else what the first non-hit was
    lease_id: int  # 0 when no lease was asked for or nothing hit
    epoch: int = 0  # the store incarnation the extents belong to (0: not known)


@dataclass(frozen=True, slots=True)
class AllocateResult:
    lease_id: int  # write lease over the ALLOCATED chunks (0 if none)
    statuses: list[AllocStatus]
    locations: list[ChunkLocation | None]  # where to write, for ALLOCATED chunks
    epoch: int = 0  # the store incarnation the extents belong to (0: not known)


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int  # events up to and including seq are reflected; read on from seq + 1
    chunks: dict[bytes, list[bytes]]  # namespace id -> committed keys


def check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"a chunk key is {KEY_BYTES} bytes, got {key!r:.40}",
            )
