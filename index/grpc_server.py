"""gRPC front of the index (``index.proto``): decode, call the wrapped ``ChunkIndex`` (the
backend inside ``MeteredIndex``), encode. Errors leave as a gRPC status with the kvtier code in
trailing metadata.

Threading: gRPC runs handlers on its thread pool; the wrapped index is thread-safe.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from kvtier.errors import ErrorCode, KvtierError
from kvtier.index import wire
from kvtier.index.api import ChunkIndex
from kvtier.index.proto import index_pb2 as pb
from kvtier.index.proto import index_pb2_grpc
from kvtier.keys import Namespace, unpack_keys

log = logging.getLogger(__name__)


def _handler(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: IndexServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except KvtierError as exc:
            _abort(context, exc)
        except (ValueError, TypeError) as exc:  # malformed fields (bad key length, ...)
            _abort(context, KvtierError(ErrorCode.INVALID_ARGUMENT, str(exc)))
        except Exception as exc:  # pragma: no cover - a bug; keep the server up
            log.exception("internal error in %s", method.__name__)
            _abort(context, KvtierError(ErrorCode.INTERNAL, repr(exc)))

    return wrapper


def _abort(context: grpc.ServicerContext, exc: KvtierError) -> None:
    context.set_trailing_metadata(((wire.ERROR_METADATA_KEY, exc.code.value),))
    context.abort(wire.grpc_status(exc.code), exc.message)


class IndexServicer(index_pb2_grpc.IndexServicer):
    def __init__(self, index: ChunkIndex, stats: Callable[[], dict[str, Any]]) -> None:
        self.index = index
        self._stats = stats

    @_handler
    def Query(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.QueryReply:
        results = self.index.query([wire.query_from_pb(q) for q in request.queries])
        return pb.QueryReply(answers=[wire.result_to_pb(r) for r in results])

    @_handler
    def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNamespaceReply:
        if request.namespace_json:
            try:
                namespace: Namespace | bytes = Namespace.model_validate_json(request.namespace_json)
            except ValueError as exc:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad namespace: {exc}") from exc
        else:
            namespace = request.ns_id
        return pb.RegisterNamespaceReply(ns_id=self.index.register_namespace(namespace))

    @_handler
    def Namespaces(
        self, request: pb.NamespacesRequest, context: grpc.ServicerContext
    ) -> pb.NamespacesReply:
        return pb.NamespacesReply(
            namespaces=[
                pb.NamespaceEntry(ns_id=ns, namespace_json=d.model_dump_json() if d else "")
                for ns, d in self.index.namespaces().items()
            ]
        )

    @_handler
    def Register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterReply:
        info = self.index.register(wire.registration_from_pb(request.registration))
        return pb.RegisterReply(info=wire.info_to_pb(info))

    @_handler
    def Unregister(
        self, request: pb.LocationRequest, context: grpc.ServicerContext
    ) -> pb.ExistedReply:
        return pb.ExistedReply(existed=self.index.unregister(request.location))

    @_handler
    def Locations(
        self, request: pb.LocationsRequest, context: grpc.ServicerContext
    ) -> pb.LocationsReply:
        return pb.LocationsReply(locations=[wire.info_to_pb(i) for i in self.index.locations()])

    @_handler
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        statuses = self.index.heartbeat(list(request.locations))
        return pb.HeartbeatReply(statuses=[s.value for s in statuses])

    @_handler
    def Drop(self, request: pb.LocationRequest, context: grpc.ServicerContext) -> pb.ExistedReply:
        return pb.ExistedReply(existed=self.index.drop(request.location))

    @_handler
    def Reap(self, request: pb.ReapRequest, context: grpc.ServicerContext) -> pb.ReapReply:
        if request.timeout_s <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "timeout_s must be > 0")
        return pb.ReapReply(dropped=self.index.reap(request.timeout_s))

    @_handler
    def Apply(self, request: pb.ApplyRequest, context: grpc.ServicerContext) -> pb.ApplyReply:
        status = self.index.apply(
            request.location,
            [wire.op_from_pb(op) for op in request.ops],
            epoch=request.epoch,
            seq_from=request.seq_from,
            seq_to=request.seq_to,
        )
        return pb.ApplyReply(status=status.value)

    @_handler
    def Replace(self, request: pb.ReplaceRequest, context: grpc.ServicerContext) -> pb.ReplaceReply:
        holdings: dict = {}
        for part in request.holdings:
            by_ns = holdings.setdefault(wire.tier_from(part.tier), {})
            by_ns.setdefault(part.ns_id, []).extend(unpack_keys(part.keys))
        self.index.replace(request.location, holdings, epoch=request.epoch, seq=request.seq)
        return pb.ReplaceReply()

    @_handler
    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimReply:
        granted = self.index.claim(request.location, request.owner, request.ttl_s)
        return pb.ClaimReply(granted=granted)

    @_handler
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        health, reason = self.index.health()
        return pb.StatsReply(
            stats_json=json.dumps(self._stats()), health=health.value, health_reason=reason
        )


def start_grpc_server(
    index: ChunkIndex,
    stats: Callable[[], dict[str, Any]],
    host: str,
    port: int,
    workers: int = 8,
) -> tuple[grpc.Server, int]:
    """Serve ``index`` on host:port (port 0 picks a free one). Returns (server, bound port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-index-grpc"),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ],
    )
    index_pb2_grpc.add_IndexServicer_to_server(IndexServicer(index, stats), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on {host}:{port}")
    server.start()
    return server, bound
