"""Conversions between the store's Python values and its protobuf messages.

Shared by the gRPC server and client so both sides agree on one encoding: keys packed as
16-byte runs, extents flattened (see store.proto).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.chunks import ChunkLocation, LookupStatus
from kvtier.core.keys import pack_keys, unpack_keys
from kvtier.store.api.events import EventBatch, EventKind, StoreEvent
from kvtier.store.api.remote import FetchResult, FetchStatus
from kvtier.store.api.types import AllocateResult, AllocStatus, LeaseStatus
from kvtier.store.proto import store_pb2 as pb

LOOKUP_STATUS = {
    LookupStatus.HIT: pb.HIT,
    LookupStatus.MISS: pb.MISS,
    LookupStatus.PENDING: pb.PENDING,
}
LOOKUP_STATUS_BACK = {v: k for k, v in LOOKUP_STATUS.items()}
ALLOC_STATUS = {
    AllocStatus.ALLOCATED: pb.ALLOCATED,
    AllocStatus.EXISTS: pb.EXISTS,
    AllocStatus.IN_PROGRESS: pb.IN_PROGRESS,
    AllocStatus.NO_SPACE: pb.NO_SPACE,
}
ALLOC_STATUS_BACK = {v: k for k, v in ALLOC_STATUS.items()}
LEASE_STATUS = {
    LeaseStatus.OK: pb.OK,
    LeaseStatus.EXPIRED: pb.EXPIRED,
    LeaseStatus.UNKNOWN: pb.UNKNOWN,
}
LEASE_STATUS_BACK = {v: k for k, v in LEASE_STATUS.items()}
EVENT_KIND = {
    EventKind.STORED: pb.STORED,
    EventKind.REMOVED: pb.REMOVED,
    EventKind.CLEARED: pb.CLEARED,
}
EVENT_KIND_BACK = {v: k for k, v in EVENT_KIND.items()}
FETCH_STATUS = {status: pb.FetchStatus.Value(f"FETCH_{status.name}") for status in FetchStatus}
FETCH_STATUS_BACK = {v: k for k, v in FETCH_STATUS.items()}


def fetch_to_pb(result: FetchResult) -> pb.FetchReply:
    return pb.FetchReply(
        status=FETCH_STATUS[result.status],
        local=result.local,
        fetched=result.fetched,
        bytes=result.bytes,
        holder_hits=result.holder_hits,
        checksum_mismatches=result.checksum_mismatches,
        present=bytes(result.present),
        message=result.message,
    )


def fetch_from_pb(msg: pb.FetchReply) -> FetchResult:
    return FetchResult(
        status=FETCH_STATUS_BACK[msg.status],
        local=msg.local,
        fetched=msg.fetched,
        bytes=msg.bytes,
        holder_hits=msg.holder_hits,
        checksum_mismatches=msg.checksum_mismatches,
        present=tuple(bool(b) for b in bytes(msg.present)),
        message=msg.message,
    )


def locations_to_pb(locations: list[ChunkLocation]) -> pb.Locations:
    # lists, not generators: protobuf's extend takes a list in one call (the hot path's reply)
    extents = [extent for loc in locations for extent in loc.extents]
    return pb.Locations(
        keys=pack_keys([loc.key for loc in locations]),
        sizes=[loc.size for loc in locations],
        checksums=[loc.checksum for loc in locations],
        extent_counts=[len(loc.extents) for loc in locations],
        extent_offsets=[off for off, _ in extents],
        extent_lengths=[length for _, length in extents],
    )


def locations_from_pb(msg: pb.Locations) -> list[ChunkLocation]:
    # the repeated fields copied to lists first: indexing protobuf's containers one element
    # at a time costs more than the rest of a lookup's decoding (the hot path's reply)
    keys = unpack_keys(msg.keys)
    sizes, checksums, counts = list(msg.sizes), list(msg.checksums), list(msg.extent_counts)
    offsets, lengths = list(msg.extent_offsets), list(msg.extent_lengths)
    if len(offsets) == len(keys) and all(c == 1 for c in counts):  # a run of pages each
        return [
            ChunkLocation(key, size, ((off, length),), checksum)
            for key, size, off, length, checksum in zip(
                keys, sizes, offsets, lengths, checksums, strict=True
            )
        ]
    out = []
    pos = 0
    for key, size, checksum, count in zip(keys, sizes, checksums, counts, strict=True):
        extents = tuple(zip(offsets[pos : pos + count], lengths[pos : pos + count], strict=True))
        pos += count
        out.append(ChunkLocation(key, size, extents, checksum))
    return out


def batch_to_pb(batch: EventBatch) -> pb.EventBatch:
    return pb.EventBatch(
        node_id=batch.node_id,
        epoch=batch.epoch,
        seq=batch.seq,
        timestamp=batch.timestamp,
        events=[
            pb.Event(
                kind=EVENT_KIND[e.kind], ns_id=e.namespace, keys=pack_keys(e.keys), tier=e.tier
            )
            for e in batch.events
        ],
    )


def batch_from_pb(msg: pb.EventBatch) -> EventBatch:
    events = tuple(
        StoreEvent(EVENT_KIND_BACK[e.kind], e.ns_id, tuple(unpack_keys(e.keys)), e.tier or "cpu")
        for e in msg.events
    )
    return EventBatch(msg.node_id, msg.epoch, msg.seq, msg.timestamp, events)


def allocated_from_pb(reply: pb.AllocateReply, epoch: int) -> AllocateResult:
    """An allocation's reply, its extents of store incarnation ``epoch``."""
    statuses = [ALLOC_STATUS_BACK[s] for s in reply.statuses]
    allocated = iter(locations_from_pb(reply.allocated))
    locations = [next(allocated) if s.value == "allocated" else None for s in statuses]
    return AllocateResult(reply.lease_id, statuses, locations, epoch, reply.lease_ttl_s)


def commit_request(
    epoch: int,
    lease_id: int,
    keys: Sequence[bytes] | None,
    checksums: Sequence[int],
    as_ns_id: bytes,
    as_keys: Sequence[bytes] | None,
) -> pb.CommitRequest:
    """A commit; with ``as_keys``, of placeholders under those names of ``as_ns_id``."""
    return pb.CommitRequest(
        epoch=epoch,
        lease_id=lease_id,
        keys=pack_keys(keys) if keys is not None else b"",
        checksums=checksums,
        as_ns_id=as_ns_id if as_keys is not None else b"",
        as_keys=pack_keys(as_keys) if as_keys is not None else b"",
    )
