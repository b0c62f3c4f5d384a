"""Conversions between the index's Python values and its protobuf messages (index.proto),
shared by the gRPC server and client so both sides agree on one encoding."""

from __future__ import annotations

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import pack_keys, unpack_keys
from kvtier.index.api import (
    INDEX_TIERS,
    ChunkOp,
    Cursor,
    Holding,
    IndexHealth,
    LocationInfo,
    LocationKind,
    LocationStatus,
    Query,
    QueryResult,
    Registration,
)
from kvtier.index.proto import index_pb2 as pb
from kvtier.store.api.events import EventKind


def _enum(cls, value: str, what: str):  # -> an enum member
    try:
        return cls(value)
    except ValueError:
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"unknown {what} {value!r}") from None


def tier_from(value: str) -> Tier:
    return _enum(Tier, value, "tier")


# -- queries ---------------------------------------------------------------------------------------


def query_to_pb(query: Query) -> pb.PromptQuery:
    if (query.keys is None) == (query.tokens is None):
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a query gives keys or tokens, not both")
    if query.tokens is not None:
        return pb.PromptQuery(
            ns_id=query.ns_id, tokens=list(map(int, query.tokens)), by_tokens=True
        )
    return pb.PromptQuery(ns_id=query.ns_id, keys=pack_keys(query.keys or []))


def query_from_pb(msg: pb.PromptQuery) -> Query:
    if msg.by_tokens:
        return Query(msg.ns_id, tokens=msg.tokens)
    return Query(msg.ns_id, keys=unpack_keys(msg.keys))


def result_to_pb(result: QueryResult) -> pb.PromptAnswer:
    answer = pb.PromptAnswer(
        ns_id=result.ns_id, num_chunks=result.num_chunks, health=result.health.value
    )
    for h in result.holdings:
        answer.holdings.append(
            pb.Holding(
                location=h.location,
                kind=h.kind.value,
                node=h.node,
                gpu_run=h.runs.get(Tier.GPU, 0),
                cpu_run=h.runs.get(Tier.CPU, 0),
                disk_run=h.runs.get(Tier.DISK, 0),
                total=h.total,
                last_seen=h.last_seen,
                stored_at=h.stored_at,
            )
        )
    return answer


def result_from_pb(msg: pb.PromptAnswer) -> QueryResult:
    holdings = []
    for h in msg.holdings:
        runs = {
            t: r for t, r in zip(INDEX_TIERS, (h.gpu_run, h.cpu_run, h.disk_run), strict=True) if r
        }
        holdings.append(
            Holding(
                h.location, LocationKind(h.kind), h.node, runs, h.total, h.last_seen, h.stored_at
            )
        )
    return QueryResult(msg.ns_id, msg.num_chunks, tuple(holdings), IndexHealth(msg.health))


# -- locations ---------------------------------------------------------------------------------


def registration_to_pb(reg: Registration) -> pb.Registration:
    return pb.Registration(
        location=reg.location,
        kind=reg.kind.value,
        namespaces=list(reg.namespaces),
        node=reg.node,
        endpoints=dict(reg.endpoints),
    )


def registration_from_pb(msg: pb.Registration) -> Registration:
    return Registration(
        msg.location,
        _enum(LocationKind, msg.kind, "location kind"),
        tuple(msg.namespaces),
        msg.node,
        dict(msg.endpoints),
    )


def info_to_pb(info: LocationInfo) -> pb.LocationInfo:
    return pb.LocationInfo(
        registration=registration_to_pb(info.registration),
        status=info.status.value,
        last_seen=info.last_seen,
        epoch=info.cursor.epoch,
        seq=info.cursor.seq,
        entries={t.value: n for t, n in info.entries.items()},
    )


def info_from_pb(msg: pb.LocationInfo) -> LocationInfo:
    return LocationInfo(
        registration_from_pb(msg.registration),
        LocationStatus(msg.status),
        msg.last_seen,
        Cursor(msg.epoch, msg.seq),
        {Tier(t): n for t, n in msg.entries.items()},
    )


# -- writes ------------------------------------------------------------------------------------


def op_to_pb(op: ChunkOp) -> pb.ChunkOp:
    return pb.ChunkOp(
        kind=op.kind.value,
        tier=op.tier.value if op.tier is not None else "",
        ns_id=op.ns_id,
        keys=pack_keys(op.keys),
    )


def op_from_pb(msg: pb.ChunkOp) -> ChunkOp:
    kind = _enum(EventKind, msg.kind, "op kind")
    tier = tier_from(msg.tier) if msg.tier or kind is not EventKind.CLEARED else None
    return ChunkOp(kind, tier, msg.ns_id, tuple(unpack_keys(msg.keys)))
