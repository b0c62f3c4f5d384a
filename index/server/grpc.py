"""gRPC front of the index (``index.proto``): decode, call the wrapped ``ChunkIndex`` (the
backend inside ``MeteredIndex``) as the caller may (``IndexAccess``: tenants, owners of
locations, bounds), encode. Errors leave as a gRPC status with the kvtier code in trailing
metadata.

Threading: gRPC runs handlers on its thread pool; the wrapped index is thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from kvtier.core import rpc
from kvtier.core.auth import Permission
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import unpack_keys
from kvtier.index.client import feed_wire, wire
from kvtier.index.client.changes import NO_FEED, ChangeKind
from kvtier.index.proto import index_pb2 as pb
from kvtier.index.proto import index_pb2_grpc
from kvtier.index.server.access import IndexAccess
from kvtier.index.server.feed import FeedingIndex

log = logging.getLogger(__name__)

P = Permission
# Who may call what (docs/security.md). A method missing here is refused to everyone.
INDEX_PERMISSIONS: Mapping[str, Permission] = {
    "Query": P.INDEX_QUERY,
    "Locations": P.INDEX_QUERY,
    "Stats": P.INDEX_QUERY,
    # on what (tenants' namespaces, one's own locations): ``IndexAccess``
    "Register": P.INDEX_ANNOUNCE,  # the index then dials the location's endpoints
    "Unregister": P.INDEX_ANNOUNCE,
    "Heartbeat": P.INDEX_ANNOUNCE,
    "RegisterNamespace": P.INDEX_WRITE,
    "Apply": P.INDEX_WRITE,
    "Replace": P.INDEX_WRITE,
    # replicas claim the sources they write on their own backend, never over the API: a
    # claim there stops every replica writing the source (until it lapses), so admins only
    "Claim": P.INDEX_ADMIN,
    "Namespaces": P.INDEX_LIST,  # every tenant's namespace: routers and admins, not engines
    # the change feed and its snapshots carry every tenant's namespaces and chunks: the same
    "Follow": P.INDEX_LIST,
    "Snapshot": P.INDEX_LIST,
    # a router replica's load and ejections, relayed to the other replicas (steers routing,
    # never what an engine loads); named after the caller's credential, so no credential
    # speaks for another's routers
    "Share": P.INDEX_SHARE,
    "Drop": P.INDEX_ADMIN,
    "Reap": P.INDEX_ADMIN,
}


FOLLOW_WAIT_S = 1.0  # longest a Follow waits for a change (it holds a gRPC worker meanwhile)
FOLLOW_LIMIT = 4096  # changes in one Follow reply at most
SNAPSHOT_KEEP_S = 60.0  # a snapshot's parts are kept this long for the calls that fetch them


class SnapshotParts:
    """Snapshots taken, cut into parts, kept for the calls that fetch their other parts (the
    newest few, for ``SNAPSHOT_KEEP_S``)."""

    def __init__(self, feeding: FeedingIndex) -> None:
        self.feeding = feeding
        self._taken: dict[str, tuple[float, list[pb.SnapshotPart]]] = {}
        self._lock = threading.Lock()

    def part(self, snapshot_id: str, part: int) -> pb.SnapshotPart:
        now = time.monotonic()
        with self._lock:
            for sid, (at, _) in list(self._taken.items()):
                if now - at > SNAPSHOT_KEEP_S:
                    del self._taken[sid]
            if not snapshot_id:
                snapshot_id = secrets.token_hex(8)
                parts = feed_wire.dump_to_parts(self.feeding.snapshot(), snapshot_id)
                while len(self._taken) >= 4:
                    del self._taken[next(iter(self._taken))]
                self._taken[snapshot_id] = (now, parts)
            taken = self._taken.get(snapshot_id)
            if taken is None:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, "snapshot expired: take another")
            if part >= len(taken[1]):
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"no part {part} in the snapshot")
            return taken[1][part]


class IndexServicer(index_pb2_grpc.IndexServicer):
    def __init__(
        self,
        access: IndexAccess,
        stats: Callable[[], dict[str, Any]],
        feeding: FeedingIndex | None = None,
    ) -> None:
        """``feeding``: the backend with its change feed (None: Follow and Snapshot refused)."""
        self.access = access
        self.index = access.index
        self._stats = stats
        self.feeding = feeding if feeding is not None and feeding.feeds else None
        self._snapshots = SnapshotParts(self.feeding) if self.feeding is not None else None

    @rpc.handler
    def Follow(self, request: pb.FollowRequest, context: grpc.ServicerContext) -> pb.FollowReply:
        if self.feeding is None:
            raise KvtierError(ErrorCode.UNSUPPORTED, NO_FEED)
        batch = self.feeding.feed.read(
            request.epoch,
            request.after,
            min(request.limit or FOLLOW_LIMIT, FOLLOW_LIMIT),
            min(max(request.wait_s, 0.0), FOLLOW_WAIT_S),
        )
        return feed_wire.batch_to_pb(batch)

    @rpc.handler
    def Share(self, request: pb.RouterShare, context: grpc.ServicerContext) -> pb.ShareReply:
        if self.feeding is None:
            raise KvtierError(ErrorCode.UNSUPPORTED, NO_FEED)
        share = feed_wire.share_from_pb(request)
        named = dataclasses.replace(share, router=f"{rpc.caller().name}/{share.router}")
        self.feeding.feed.append(ChangeKind.ROUTER, share=named)
        return pb.ShareReply()

    @rpc.handler
    def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotPart:
        if self._snapshots is None:
            raise KvtierError(ErrorCode.UNSUPPORTED, NO_FEED)
        return self._snapshots.part(request.snapshot_id, request.part)

    @rpc.handler
    def Query(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.QueryReply:
        queries = [wire.query_from_pb(q) for q in request.queries]
        results = self.access.query(rpc.caller(), queries)
        return pb.QueryReply(answers=[wire.result_to_pb(r) for r in results])

    @rpc.handler
    def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNamespaceReply:
        ns_id = self.access.register_namespace(rpc.caller(), request.namespace_json, request.ns_id)
        return pb.RegisterNamespaceReply(ns_id=ns_id)

    @rpc.handler
    def Namespaces(
        self, request: pb.NamespacesRequest, context: grpc.ServicerContext
    ) -> pb.NamespacesReply:
        return pb.NamespacesReply(
            namespaces=[
                pb.NamespaceEntry(ns_id=ns, namespace_json=d.model_dump_json() if d else "")
                for ns, d in self.access.namespaces(rpc.caller()).items()
            ]
        )

    @rpc.handler
    def Register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterReply:
        registration = wire.registration_from_pb(request.registration)
        info = self.access.register(rpc.caller(), registration)
        return pb.RegisterReply(info=wire.info_to_pb(info))

    @rpc.handler
    def Unregister(
        self, request: pb.LocationRequest, context: grpc.ServicerContext
    ) -> pb.ExistedReply:
        return pb.ExistedReply(existed=self.access.unregister(rpc.caller(), request.location))

    @rpc.handler
    def Locations(
        self, request: pb.LocationsRequest, context: grpc.ServicerContext
    ) -> pb.LocationsReply:
        infos = self.access.locations(rpc.caller())
        return pb.LocationsReply(locations=[wire.info_to_pb(i) for i in infos])

    @rpc.handler
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        statuses = self.access.heartbeat(rpc.caller(), list(request.locations))
        return pb.HeartbeatReply(statuses=[s.value for s in statuses])

    @rpc.handler
    def Drop(self, request: pb.LocationRequest, context: grpc.ServicerContext) -> pb.ExistedReply:
        return pb.ExistedReply(existed=self.index.drop(request.location))

    @rpc.handler
    def Reap(self, request: pb.ReapRequest, context: grpc.ServicerContext) -> pb.ReapReply:
        if request.timeout_s <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "timeout_s must be > 0")
        return pb.ReapReply(dropped=self.index.reap(request.timeout_s))

    @rpc.handler
    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyReply:
        status = self.access.apply(
            rpc.caller(),
            request.location,
            [wire.op_from_pb(op) for op in request.ops],
            epoch=request.epoch,
            seq_from=request.seq_from,
            seq_to=request.seq_to,
        )
        return pb.ApplyReply(status=status.value)

    @rpc.handler
    def Replace(self, request: pb.ReplaceRequest, context: grpc.ServicerContext) -> pb.ReplaceReply:
        holdings: dict = {}
        for part in request.holdings:
            by_ns = holdings.setdefault(wire.tier_from(part.tier), {})
            by_ns.setdefault(part.ns_id, []).extend(unpack_keys(part.keys))
        self.access.replace(
            rpc.caller(), request.location, holdings, epoch=request.epoch, seq=request.seq
        )
        return pb.ReplaceReply()

    @rpc.handler
    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimReply:
        granted = self.access.claim(rpc.caller(), request.location, request.owner, request.ttl_s)
        return pb.ClaimReply(granted=granted)

    @rpc.handler
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        # the stats carry the health (``service._stats``), its reason as the caller may see it
        stats = self.access.stats(rpc.caller(), self._stats())
        return pb.StatsReply(
            stats_json=json.dumps(stats),
            health=stats["health"],
            health_reason=stats["health_reason"],
        )


def start_grpc_server(
    access: IndexAccess,
    stats: Callable[[], dict[str, Any]],
    host: str,
    port: int,
    workers: int = 8,
    security: rpc.ServerSecurity | None = None,
    feeding: FeedingIndex | None = None,
) -> tuple[grpc.Server, int]:
    """Serve the index on host:port (port 0 picks a free one). Returns (server, bound port).
    ``security``: who may call what (``INDEX_PERMISSIONS``); ``access``: on what; ``feeding``:
    the backend's change feed, for Follow and Snapshot."""
    servicer = IndexServicer(access, stats, feeding)
    return rpc.start_server(
        [(index_pb2_grpc.add_IndexServicer_to_server, servicer)],
        host,
        port,
        workers,
        "kvtier-index-grpc",
        security=security,
    )
