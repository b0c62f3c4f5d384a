"""gRPC front of a node store (``store.proto``).

Each RPC decodes its request, calls the wrapped ``StoreClient`` (a ``NodeStore``, usually inside
a ``MeteredStore``), and encodes the reply. Errors leave as a gRPC status with the kvtier code in
trailing metadata; a request from a client attached to a previous store epoch is refused.

Threading: gRPC runs handlers on its thread pool; the wrapped store is thread-safe.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace, unpack_keys
from kvtier.store import wire
from kvtier.store.api import StoreClient
from kvtier.store.events import EventGap
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc

log = logging.getLogger(__name__)


def _handler(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map KvtierError / bad input to a gRPC status with the kvtier error code attached."""

    @functools.wraps(method)
    def wrapper(self: StoreServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            epoch = getattr(request, "epoch", None)
            if epoch and epoch != self.epoch:
                raise KvtierError(
                    ErrorCode.STALE_EPOCH,
                    f"store restarted: client epoch {epoch:016x}, store epoch {self.epoch:016x}",
                )
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
    context.abort(wire.GRPC_STATUS[exc.code], exc.message)


class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(self, store: StoreClient) -> None:
        self.store = store
        self.epoch = store.info().epoch

    @_handler
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        info = self.store.info()
        return pb.InfoReply(
            node_id=info.node_id,
            epoch=info.epoch,
            segment_name=info.segment_name,
            segment_size=info.segment_size,
            page_size=info.page_size,
            version=info.version,
            transfer_address=info.transfer_address,
            transfer_base=info.transfer_base,
        )

    @_handler
    def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNamespaceReply:
        try:
            namespace = Namespace.model_validate_json(request.namespace_json)
        except ValueError as exc:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad namespace: {exc}") from exc
        ns_id = self.store.register_namespace(namespace, request.chunk_bytes)
        return pb.RegisterNamespaceReply(ns_id=ns_id)

    @_handler
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        ttl = request.lease_ttl_s if request.lease_ttl_s > 0 else None
        result = self.store.lookup(request.ns_id, unpack_keys(request.keys), ttl)
        return pb.LookupReply(
            hits=wire.locations_to_pb(result.hits),
            stop=wire.LOOKUP_STATUS[result.stop],
            lease_id=result.lease_id,
        )

    @_handler
    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateReply:
        ttl = request.ttl_s if request.ttl_s > 0 else None
        result = self.store.allocate(
            request.ns_id, unpack_keys(request.keys), list(request.sizes), ttl
        )
        reply = pb.AllocateReply(
            lease_id=result.lease_id,
            allocated=wire.locations_to_pb([loc for loc in result.locations if loc is not None]),
        )
        reply.statuses.extend(wire.ALLOC_STATUS[s] for s in result.statuses)
        return reply

    @_handler
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        keys = unpack_keys(request.keys) if request.keys else None
        committed = self.store.commit(request.lease_id, keys, list(request.checksums))
        return pb.CommitReply(committed=committed)

    @_handler
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        keys = unpack_keys(request.keys) if request.keys else None
        return pb.AbortReply(aborted=self.store.abort(request.lease_id, keys))

    @_handler
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        statuses = self.store.release(list(request.lease_ids))
        reply = pb.ReleaseReply()
        reply.statuses.extend(wire.LEASE_STATUS[s] for s in statuses)
        return reply

    @_handler
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        ttl = request.ttl_s if request.ttl_s > 0 else None
        return pb.RenewReply(ttl_s=self.store.renew(request.lease_id, ttl))

    @_handler
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteReply:
        return pb.DeleteReply(deleted=self.store.delete(request.ns_id, unpack_keys(request.keys)))

    @_handler
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearReply:
        return pb.ClearReply(cleared=self.store.clear())

    @_handler
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(stats_json=json.dumps(self.store.stats()))

    @_handler
    def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotReply:
        snap = self.store.snapshot()
        info = self.store.info()
        return pb.SnapshotReply(
            seq=snap.seq,
            node_id=info.node_id,
            epoch=info.epoch,
            chunks=[
                pb.NamespaceChunks(ns_id=ns, keys=b"".join(keys))
                for ns, keys in snap.chunks.items()
            ],
        )

    @_handler
    def ReadEvents(
        self, request: pb.ReadEventsRequest, context: grpc.ServicerContext
    ) -> pb.ReadEventsReply:
        timeout = min(max(request.timeout_s, 0.0), 30.0)
        got = self.store.read_events(
            max(1, request.from_seq), request.max_batches or 256, timeout or None
        )
        if isinstance(got, EventGap):
            return pb.ReadEventsReply(gap_oldest=got.oldest)
        return pb.ReadEventsReply(batches=[wire.batch_to_pb(b) for b in got])

    @_handler
    def LeaseForPeer(
        self, request: pb.LookupRequest, context: grpc.ServicerContext
    ) -> pb.LookupReply:
        ttl = request.lease_ttl_s if request.lease_ttl_s > 0 else None
        result = self.store.lease_for_peer(request.ns_id, unpack_keys(request.keys), ttl)
        return pb.LookupReply(
            hits=wire.locations_to_pb(result.hits),
            stop=wire.LOOKUP_STATUS[result.stop],
            lease_id=result.lease_id,
        )

    @_handler
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchReply:
        timeout = request.timeout_s if request.timeout_s > 0 else None
        result = self.store.fetch(request.ns_id, unpack_keys(request.keys), request.holder, timeout)
        return wire.fetch_to_pb(result)

    def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.SubscribeReply]:
        seq = max(1, request.from_seq)
        while context.is_active():
            try:
                got = self.store.read_events(seq, timeout=0.5)
            except KvtierError:
                return  # store shutting down: end the stream
            if isinstance(got, EventGap):
                yield pb.SubscribeReply(gap_oldest=got.oldest)
                return
            for batch in got:
                yield pb.SubscribeReply(batch=wire.batch_to_pb(batch))
                seq = batch.seq + 1


def start_grpc_server(
    store: StoreClient, host: str, port: int, workers: int = 16
) -> tuple[grpc.Server, int]:
    """Serve ``store`` on host:port (port 0 picks a free one). Returns (server, bound port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-grpc"),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ],
    )
    store_pb2_grpc.add_StoreServicer_to_server(StoreServicer(store), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on {host}:{port}")
    server.start()
    return server, bound
