"""What a node store answers: statuses and results of its control API (clients, the wire
codec and the store itself share them)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.chunks import ChunkLocation, LookupStatus


class AllocStatus(enum.StrEnum):
    ALLOCATED = "allocated"  # write the bytes, then commit
    EXISTS = "exists"  # already stored: nothing to write (idempotent put)
    IN_PROGRESS = "in_progress"  # another writer is storing it right now
    NO_SPACE = "no_space"  # the pool is full of pinned / being-written chunks


class LeaseStatus(enum.StrEnum):
    OK = "ok"  # released in time: everything read under it was stable
    EXPIRED = "expired"  # reaped before release: a copy made under it may be torn
    UNKNOWN = "unknown"  # never issued by this store incarnation (or released twice)


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: list[ChunkLocation]  # the longest committed prefix of the keys asked
    stop: LookupStatus  # HIT when every key hit, else what the first non-hit was
    lease_id: int  # 0 when no lease was asked for or nothing hit
    epoch: int = 0  # the store incarnation the extents belong to (0: not known)
    # seconds the lease was granted for: the store caps what was asked (max_lease_ttl_s,
    # max_lease_lifetime_s) without an error; 0 = no lease, or a store that does not say
    lease_ttl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AllocateResult:
    lease_id: int  # write lease over the ALLOCATED chunks (0 if none)
    statuses: list[AllocStatus]
    locations: list[ChunkLocation | None]  # where to write, for ALLOCATED chunks
    epoch: int = 0  # the store incarnation the extents belong to (0: not known)
    lease_ttl_s: float = 0.0  # seconds the write lease was granted for (0: none / not said)


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int  # events up to and including seq are reflected; read on from seq + 1
    chunks: dict[bytes, list[bytes]]  # namespace id -> committed keys
    disk_chunks: dict[bytes, list[bytes]] = field(default_factory=dict)  # on the node's disk


@dataclass(frozen=True, slots=True)
class AllocateCall:
    """One allocation of a batch (``StoreClient.allocate_many``)."""

    ns_id: bytes
    keys: Sequence[bytes]
    sizes: Sequence[int]


@dataclass(frozen=True, slots=True)
class CommitCall:
    """One commit of a batch (``StoreClient.commit_many``); ``keys=None``: the whole lease."""

    lease_id: int
    keys: Sequence[bytes] | None
    checksums: Sequence[int]
    # placeholders committing under other names (``StoreCore.commit``): one per key, in order
    as_ns_id: bytes = b""
    as_keys: Sequence[bytes] | None = None
