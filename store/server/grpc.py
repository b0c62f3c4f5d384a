"""gRPC front of a node store (``store.proto``).

Each RPC decodes its request, calls the served store's part that answers it (the state
machine, ``NodeStore.core``, for namespaces, leases, sessions and chunks; the remote tier's
fetcher for a fetch and a peer's lease; the ``NodeStore`` for its info, stats and events),
times it (``StoreMetrics``), and encodes the reply. Errors leave as a gRPC status with the
kvtier code in trailing metadata; a request from a client attached to a previous store epoch
is refused.

Threading: gRPC runs handlers on its thread pool; the wrapped store is thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc

from kvtier.core import rpc
from kvtier.core.auth import NONCE_BYTES, Permission, prove
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import MAX_NAMESPACE_JSON_BYTES, Namespace, unpack_keys
from kvtier.store.api.events import EventGap
from kvtier.store.client import wire
from kvtier.store.node import NodeStore, remote_tier_off
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc
from kvtier.store.remote.fetch import Fetcher
from kvtier.store.server.metrics import StoreMetrics
from kvtier.store.state.namespaces import unknown_namespace

log = logging.getLogger(__name__)

P = Permission
# Who may call what (docs/security.md). A method missing here is refused to everyone.
STORE_PERMISSIONS: Mapping[str, Permission] = {
    "Info": P.STORE_INFO,
    "Prove": P.PUBLIC,  # before a caller presents its token here (docs/security.md)
    "RegisterNamespace": P.STORE_DATA,
    "Lookup": P.STORE_DATA,
    "Allocate": P.STORE_DATA,
    "Commit": P.STORE_DATA,
    "Abort": P.STORE_DATA,
    "Release": P.STORE_DATA,
    "Renew": P.STORE_DATA,
    "Delete": P.STORE_DATA,
    "Fetch": P.STORE_DATA,
    "StageFromDisk": P.STORE_DATA,
    "OpenSession": P.STORE_DATA,
    "Heartbeat": P.STORE_DATA,
    "CloseSession": P.STORE_DATA,
    "Clear": P.STORE_ADMIN,
    "Stats": P.STORE_OBSERVE,
    "Snapshot": P.STORE_OBSERVE,
    "ReadEvents": P.STORE_OBSERVE,
    "LeaseForPeer": P.STORE_PEER,
}


class TenantGate:
    """Which tenant (salt digest) each namespace id belongs to, so a tenant's engine touches
    only its own. An engine limited to some tenants gets the same answer for a namespace that
    is another tenant's as for one never registered: it cannot probe which exist.

    It keeps no table of its own: ``tenant_of`` reads the store's (an id's salt is part of
    what the id hashes, so it never changes). A table here grew with every namespace anyone
    tried to register, refused or long retired."""

    def __init__(self, tenant_of: Callable[[bytes], str | None]) -> None:
        """``tenant_of``: the salt digest of a registered namespace id, None otherwise."""
        self._tenant_of = tenant_of

    def register(self, namespace: Namespace) -> None:
        caller = rpc.caller()
        if not caller.may_use_salt(namespace.cache_salt):
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                f"{caller.name} may not use this namespace's tenant (cache_salt)",
            )

    def check(self, ns_id: bytes) -> None:
        caller = rpc.caller()
        if caller.salts is None:
            return
        salt = self._tenant_of(ns_id)
        if salt is None or not caller.may_use_salt(salt):
            raise unknown_namespace(ns_id)  # the store's own words for one never registered


def require_session(session: int, what: str) -> None:
    """A lease taken over gRPC belongs to a session: the store bounds what each session
    holds (``store.max_leases_per_session``), and a lease without one would escape that."""
    if not session:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"{what} needs a session: open one (OpenSession) and pass its id",
        )


class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(
        self,
        node: NodeStore,
        own_token: str | None = None,
        tenant_of: Callable[[bytes], str | None] | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        """``own_token``: this store's credential, proved (never sent) to ``Prove`` callers.
        ``tenant_of``: a registered namespace's salt digest (default: the store's namespace
        table). ``metrics``: where each operation's latency goes (None: not timed)."""
        self.node = node
        self.core = node.core
        self.fetcher: Fetcher | None = node.remote.fetcher if node.remote is not None else None
        self.metrics = metrics
        self._latency: dict[str, Any] = {}  # op -> its latency histogram child
        self._own_token = own_token
        info = node.info()
        self.epoch = info.epoch
        self._session_timeout_s = info.session_timeout_s
        self.tenants = TenantGate(tenant_of or node.core.namespaces.salt_of)

    @contextlib.contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        """Time the store's own work for ``op`` (not the request's decoding or the reply's)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.metrics is not None:
                child = self._latency.get(op)
                if child is None:  # a labelled child looked up once (it costs a lock a call)
                    child = self._latency[op] = self.metrics.latency.labels(op)
                child.observe(time.perf_counter() - start)

    def _remote(self) -> Fetcher:
        if self.fetcher is None:
            raise remote_tier_off(self.node.config.node_id)
        return self.fetcher

    def check(self, request: Any) -> None:
        """Refuse a client attached to a previous incarnation: its offsets mean nothing here."""
        epoch = getattr(request, "epoch", None)
        if epoch and epoch != self.epoch:
            raise KvtierError(
                ErrorCode.STALE_EPOCH,
                f"store restarted: client epoch {epoch:016x}, store epoch {self.epoch:016x}",
            )

    @rpc.handler
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        info = self.node.info()
        return pb.InfoReply(
            node_id=info.node_id,
            epoch=info.epoch,
            segment_name=info.segment_name,
            segment_size=info.segment_size,
            page_size=info.page_size,
            version=info.version,
            transfer_address=info.transfer_address,
            transfer_base=info.transfer_base,
            lease_ttl_s=info.lease_ttl_s,
            session_timeout_s=info.session_timeout_s,
            control_socket=info.control_socket,
            view_offset=info.view_offset,
            view_bytes=info.view_bytes,
        )

    @rpc.handler
    def Prove(self, request: pb.ProveRequest, context: grpc.ServicerContext) -> pb.ProveReply:
        low, high = NONCE_BYTES
        if not low <= len(request.nonce) <= high:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"a nonce is {low}-{high} bytes")
        if self._own_token is None:
            return pb.ProveReply()
        return pb.ProveReply(proof=prove(self._own_token, request.nonce))

    @rpc.handler
    def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNamespaceReply:
        size = len(request.namespace_json)
        if size > MAX_NAMESPACE_JSON_BYTES:  # before parsing it: kept, it would cost that much
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"a namespace definition is at most {MAX_NAMESPACE_JSON_BYTES} bytes of JSON, "
                f"got {size}",
            )
        try:
            namespace = Namespace.model_validate_json(request.namespace_json)
        except ValueError as exc:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad namespace: {exc}") from exc
        self.tenants.register(namespace)  # refused before it exists
        with self._timed("register_namespace"):
            ns_id = self.core.register_namespace(namespace, request.chunk_bytes)
        return pb.RegisterNamespaceReply(ns_id=ns_id)

    @rpc.handler
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        self.tenants.check(request.ns_id)
        ttl = request.lease_ttl_s if request.lease_ttl_s > 0 else None
        if ttl is not None:
            require_session(request.session, "a leased lookup")
        keys = unpack_keys(request.keys)
        with self._timed("lookup"):
            result = self.core.lookup(request.ns_id, keys, ttl, session=request.session)
        if ttl is not None:  # an engine: its next leased lookups can be answered on its node
            self.core.grant_pin_row(request.session)
        return pb.LookupReply(
            hits=wire.locations_to_pb(result.hits),
            stop=wire.LOOKUP_STATUS[result.stop],
            lease_id=result.lease_id,
            lease_ttl_s=result.lease_ttl_s,
        )

    @rpc.handler
    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateReply:
        self.tenants.check(request.ns_id)
        require_session(request.session, "allocate")
        ttl = request.ttl_s if request.ttl_s > 0 else None
        keys, sizes = unpack_keys(request.keys), list(request.sizes)
        with self._timed("allocate"):
            result = self.core.allocate(request.ns_id, keys, sizes, ttl, session=request.session)
        self.core.grant_pin_row(request.session)
        reply = pb.AllocateReply(
            lease_id=result.lease_id,
            lease_ttl_s=result.lease_ttl_s,
            allocated=wire.locations_to_pb([loc for loc in result.locations if loc is not None]),
        )
        reply.statuses.extend(wire.ALLOC_STATUS[s] for s in result.statuses)
        return reply

    @rpc.handler
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        keys = unpack_keys(request.keys) if request.keys else None
        as_keys = None
        if request.as_keys:
            self.tenants.check(request.as_ns_id)
            as_keys = unpack_keys(request.as_keys)
        with self._timed("commit"):
            committed = self.core.commit(
                request.lease_id,
                keys,
                list(request.checksums),
                as_ns_id=request.as_ns_id,
                as_keys=as_keys,
            )
        return pb.CommitReply(committed=committed)

    @rpc.handler
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        keys = unpack_keys(request.keys) if request.keys else None
        with self._timed("abort"):
            aborted = self.core.abort(request.lease_id, keys)
        return pb.AbortReply(aborted=aborted)

    @rpc.handler
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        with self._timed("release"):
            statuses = self.core.release(list(request.lease_ids))
        reply = pb.ReleaseReply()
        reply.statuses.extend(wire.LEASE_STATUS[s] for s in statuses)
        return reply

    @rpc.handler
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        ttl = request.ttl_s if request.ttl_s > 0 else None
        with self._timed("renew"):
            granted = self.core.renew(request.lease_id, ttl)
        return pb.RenewReply(ttl_s=granted)

    @rpc.handler
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionReply:
        with self._timed("open_session"):
            session = self.core.open_session()
        if request.view_leases:  # an engine of this node: its hits can be leased on its side
            self.core.grant_pin_row(session)
        return pb.OpenSessionReply(session=session, timeout_s=self._session_timeout_s)

    @rpc.handler
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        with self._timed("heartbeat"):
            alive = self.core.heartbeat(request.session)
        return pb.HeartbeatReply(alive=alive)

    @rpc.handler
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionReply:
        with self._timed("close_session"):
            released = self.core.close_session(request.session)
        return pb.CloseSessionReply(released=released)

    @rpc.handler
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteReply:
        self.tenants.check(request.ns_id)
        keys = unpack_keys(request.keys)
        with self._timed("delete"):
            deleted = self.core.delete(request.ns_id, keys)
        return pb.DeleteReply(deleted=deleted)

    @rpc.handler
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearReply:
        with self._timed("clear"):
            cleared = self.core.clear()
        return pb.ClearReply(cleared=cleared)

    @rpc.handler
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(stats_json=json.dumps(self.node.stats()))

    @rpc.handler
    def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotReply:
        with self._timed("snapshot"):
            snap = self.node.snapshot()
        return pb.SnapshotReply(
            seq=snap.seq,
            node_id=self.core.node_id,
            epoch=self.core.epoch,
            chunks=[
                pb.NamespaceChunks(ns_id=ns, keys=b"".join(keys))
                for ns, keys in snap.chunks.items()
            ],
            disk_chunks=[
                pb.NamespaceChunks(ns_id=ns, keys=b"".join(keys))
                for ns, keys in snap.disk_chunks.items()
            ],
        )

    @rpc.handler
    def ReadEvents(
        self, request: pb.ReadEventsRequest, context: grpc.ServicerContext
    ) -> pb.ReadEventsReply:
        timeout = min(max(request.timeout_s, 0.0), 30.0)
        got = self.node.read_events(
            max(1, request.from_seq), request.max_batches or 256, timeout or None
        )
        if isinstance(got, EventGap):
            return pb.ReadEventsReply(gap_oldest=got.oldest)
        return pb.ReadEventsReply(batches=[wire.batch_to_pb(b) for b in got])

    @rpc.handler
    def LeaseForPeer(
        self, request: pb.LookupRequest, context: grpc.ServicerContext
    ) -> pb.LookupReply:
        require_session(request.session, "LeaseForPeer")
        ttl = request.lease_ttl_s if request.lease_ttl_s > 0 else None
        keys = unpack_keys(request.keys)
        self.core.limits.check_batch(len(keys))
        with self._timed("lease_for_peer"):
            # Under the peer's session: it ends with it, and counts against its bounds.
            result = self._remote().lease_for_peer(request.ns_id, keys, ttl, request.session)
        return pb.LookupReply(
            hits=wire.locations_to_pb(result.hits),
            stop=wire.LOOKUP_STATUS[result.stop],
            lease_id=result.lease_id,
            lease_ttl_s=result.lease_ttl_s,
        )

    @rpc.handler
    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.FetchReply:
        self.tenants.check(request.ns_id)
        timeout = request.timeout_s if request.timeout_s > 0 else None
        keys = unpack_keys(request.keys)
        self.core.limits.check_batch(len(keys))
        start = time.perf_counter()
        result = self._remote().fetch(request.ns_id, keys, request.holder, timeout)
        if self.metrics is not None:
            self.metrics.fetch_latency.observe(time.perf_counter() - start)
            for phase, seconds in result.phases.items():
                self.metrics.fetch_phase_latency.labels(phase).observe(seconds)
            self.metrics.fetches.labels(result.status.value).inc()
            self.metrics.fetch_bytes.inc(result.bytes)
        return wire.fetch_to_pb(result)

    @rpc.handler
    def StageFromDisk(
        self, request: pb.StageFromDiskRequest, context: grpc.ServicerContext
    ) -> pb.FetchReply:
        self.tenants.check(request.ns_id)
        if not request.timeout_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a stage needs a timeout_s > 0")
        keys = unpack_keys(request.keys)
        start = time.perf_counter()
        result = self.node.stage_from_disk(request.ns_id, keys, request.timeout_s)
        if self.metrics is not None:
            self.metrics.disk_stage_latency.observe(time.perf_counter() - start)
        return wire.fetch_to_pb(result)


def start_grpc_server(
    node: NodeStore,
    host: str,
    port: int,
    workers: int = 16,
    security: rpc.ServerSecurity | None = None,
    unix_socket: Path | None = None,
    max_message_bytes: int = rpc.MESSAGE_LIMIT,
    tenant_of: Callable[[bytes], str | None] | None = None,
    metrics: StoreMetrics | None = None,
    servicer: StoreServicer | None = None,
) -> tuple[grpc.Server, int]:
    """Serve ``node`` on host:port (port 0 picks a free one) and ``unix_socket``. Returns
    (server, bound port). ``security``: who may call what (``STORE_PERMISSIONS``).
    ``tenant_of``: a registered namespace's salt digest (``TenantGate``); ``metrics``: where
    the calls are timed. ``servicer``: one already made (shared with the control socket)."""
    own_token = security.own_token if security is not None else None
    servicer = servicer or StoreServicer(node, own_token, tenant_of, metrics)
    return rpc.start_server(
        [(store_pb2_grpc.add_StoreServicer_to_server, servicer)],
        host,
        port,
        workers,
        "kvtier-grpc",
        security=security,
        unix_socket=unix_socket,
        max_message_bytes=max_message_bytes,
    )
