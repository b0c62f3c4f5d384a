"""What the scheduler-side connector tells the workers each step, and what they answer.

All control-plane work (lookups, leases, allocation, commit) happens on the scheduler side; a
worker only copies bytes between its KV pages and the node's shared pool, then reports. So the
objects here are plain, picklable values: they cross from vLLM's EngineCore process to each
worker process every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.core.chunks import SegmentRef

__all__ = [
    "ChunkCopy",
    "KvtierMetadata",
    "KvtierWorkerMetadata",
    "LoadJob",
    "SaveJob",
    "SegmentRef",
]

Extent = tuple[int, int]


@dataclass(frozen=True)
class ChunkCopy:
    """Kept blocks ``first_block .. first_block + len(block_ids)`` of one KV cache group of
    one chunk <-> that group's KV blocks (a hybrid model's chunk has one copy per group)."""

    extents: tuple[Extent, ...]  # the whole chunk's bytes in the segment
    checksum: int  # of the whole chunk; 0 = not known (not verified)
    first_block: int  # index of the first copied block among the group's kept blocks
    block_ids: tuple[int, ...]  # vLLM block ids receiving (load) / giving (save) the pages
    key: bytes = b""  # the chunk's key (a worker names a corrupt chunk by it)
    group: int = 0  # the KV cache group (``KvGeometry.groups``) the blocks belong to


@dataclass
class LoadJob:
    req_id: str
    segments: dict[int, SegmentRef]  # per TP rank: the store incarnation the extents are of
    chunks: dict[int, list[ChunkCopy]]  # per TP rank
    is_async: bool
    verify: bool
    # Set when the scheduler already knows the data cannot be trusted (a lease lapsed, the
    # store restarted since the lookup): the worker copies nothing and reports every block
    # as a load error. The text says why (logged by the worker).
    failed: str = ""
    error_block_ids: tuple[int, ...] = ()  # blocks to fail when there are no chunks

    def block_ids(self, rank: int) -> list[int]:
        ids = [b for c in self.chunks.get(rank, []) for b in c.block_ids]
        return ids or list(self.error_block_ids)

    def all_block_ids(self) -> set[int]:
        return {b for rank in self.chunks for b in self.block_ids(rank)} | set(self.error_block_ids)


@dataclass
class SaveJob:
    job_id: int
    req_id: str
    segments: dict[int, SegmentRef]  # per TP rank: the store incarnation the extents are of
    chunks: dict[int, list[ChunkCopy]]  # per TP rank, in key order


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # finished requests whose blocks vLLM held for a late save: after this step's copies the
    # workers report them as finished sending, and vLLM frees the blocks
    release_blocks: list[str] = field(default_factory=list)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step, from every worker: which saves and loads finished, per rank."""

    saved: dict[int, set[int]] = field(default_factory=dict)  # job id -> ranks that copied
    save_failed: dict[int, set[int]] = field(default_factory=dict)
    loaded: dict[str, set[int]] = field(default_factory=dict)  # req id -> ranks done
    load_failed: dict[str, set[int]] = field(default_factory=dict)
    # req id -> (rank, chunk key) of chunks whose bytes failed their checksum
    corrupt: dict[str, set[tuple[int, bytes]]] = field(default_factory=dict)
    error_blocks: set[int] = field(default_factory=set)  # every block reported as a load error

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        _merge(self.saved, other.saved)
        _merge(self.save_failed, other.save_failed)
        _merge(self.loaded, other.loaded)
        _merge(self.load_failed, other.load_failed)
        _merge(self.corrupt, other.corrupt)
        self.error_blocks |= other.error_blocks
        return self

    def is_empty(self) -> bool:
        return not (
            self.saved or self.save_failed or self.loaded or self.load_failed or self.corrupt
        )


def _merge(mine: dict[Any, set[Any]], theirs: dict[Any, set[Any]]) -> None:
    for key, items in theirs.items():
        mine.setdefault(key, set()).update(items)
