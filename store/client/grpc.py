"""Both surfaces of the store's API (``StoreClient``, ``StoreAdmin``) over gRPC, for processes
that map the pool of a ``kvtier store serve`` and for those that administer or follow it.

The client remembers the store epoch it attached to and sends it with every request; after a
store restart every call fails with STALE_EPOCH until the caller re-attaches (``reattach``),
so a client can never apply offsets from one pool incarnation to another.

Sessions: the client's leases belong to its own session, opened on its first lease-creating
call and heartbeaten from a daemon thread (``kvtier.store.client.own_session``), so the store
ends them within seconds when this process dies; ``close()`` ends it.

Threading: thread-safe (one channel, gRPC stubs are thread-safe).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import grpc

from kvtier.core import rpc
from kvtier.core.auth import Authenticator, Principal
from kvtier.core.chunks import LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, pack_keys, unpack_keys
from kvtier.store.api import StoreAdmin, StoreClient, StoreInfo
from kvtier.store.api.events import EventBatch, EventGap
from kvtier.store.api.remote import FetchResult
from kvtier.store.api.types import (
    AllocateCall,
    AllocateResult,
    CommitCall,
    LeaseStatus,
    LookupResult,
    Snapshot,
)
from kvtier.store.client import view_leases, wire
from kvtier.store.client.control import METHODS as CONTROL_METHODS
from kvtier.store.client.control import ControlChannel, ControlUnreachable
from kvtier.store.client.local import NodeLocalPath
from kvtier.store.client.own_session import OwnSession
from kvtier.store.client.proof import verify_store
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc

# A fetch's reply may come this long after its own deadline (the store's last control call).
FETCH_REPLY_MARGIN_S = 5.0
CLOSE_SESSION_TIMEOUT_S = 2.0  # close() does not wait longer for an unreachable store


class GrpcStoreClient(StoreClient, StoreAdmin):
    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        lazy: bool = False,
        auth: rpc.ClientAuth | None = None,
        verify: Authenticator | None = None,
        fast_control: bool = True,
        view_leases: bool = True,
    ) -> None:
        """``address``: ``host:port`` or ``unix:/path`` (the node's socket: no token needed).
        ``fast_control``: make the hot-path calls on the store's control socket when it
        serves one (``kvtier.store.client.control``); gRPC otherwise.
        ``view_leases``: with it, lease hits from the store's shared lease region when it has
        one (``kvtier.store.client.view_leases``: no call), else through the store.
        ``lazy``: do not fail when the store is not reachable yet (an engine may start
        before its node store); every call then answers UNAVAILABLE until it is. ``auth``:
        the token / TLS this client presents. ``verify``: the address came from someone
        else (an announcement, a peer list): the store must prove a node credential known
        to this authenticator before ``auth``'s token is sent there (``verify_store``)."""
        self.address = address
        self.timeout_s = timeout_s
        self.proved: Principal | None = None
        if verify is not None:
            self.proved = verify_store(address, auth, verify, timeout_s)
        self._channel = rpc.open_channel(address, auth)
        # the control socket and the shared view, of a store on this node (never a peer's)
        self._local = NodeLocalPath(
            fast_control and verify is None,
            auth.token if auth is not None else None,
            timeout_s,
            view_leases=view_leases,
        )
        self._stub = store_pb2_grpc.StoreStub(self._channel)
        self._info: StoreInfo | None = None
        # How many of this client's sessions ended at the store (timed out, store restarted):
        # a lease taken before the count moved may be gone, whatever its TTL says.
        self.sessions_ended = 0
        self._own = OwnSession(self._open_own_session_at_store, self.heartbeat, self._count_ended)
        self._reachable = True  # the last call got an answer (close() skips a dead store)
        try:
            self._info = self._fetch_info()
        except KvtierError as exc:
            if not lazy or exc.code is not ErrorCode.UNAVAILABLE:
                raise  # lazy: a store not up yet is attached to on first use

    @property
    def control(self) -> ControlChannel | None:
        """The store's control socket this client calls the hot path on (None: gRPC only)."""
        return self._local.control

    @property
    def view_misses(self) -> int:
        """Lookups the store's shared view answered (misses) without a call."""
        return self._local.view_misses

    @property
    def view_hits(self) -> int:
        """Leased lookups answered (and pinned) from the view's lease region without a call."""
        return self._local.view_hits

    @property
    def epoch(self) -> int:
        return self.info().epoch

    def reattach(self) -> StoreInfo:
        """Adopt the store's current epoch (after STALE_EPOCH). Returns the new info. The
        session of the previous incarnation is gone with it: the next lease opens one."""
        # Attached before: the store restarted, so it is coming back; ride out the channel's
        # reconnect backoff. Never attached (a store not up yet): fail fast, as every call does.
        self._info = self._fetch_info(wait_for_ready=self._info is not None)
        self._own.drop(self._own.session)
        return self._info

    def _call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        control = self._local.control
        if control is not None and name in CONTROL_METHODS:
            try:
                return control.call(name, request)
            except ControlUnreachable:
                pass  # over gRPC, which answers (STALE_EPOCH, UNAVAILABLE) or says why
        try:
            reply = getattr(self._stub, name)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as exc:
            error = rpc.error_from_rpc(exc, f"store {self.address}")
            self._reachable = error.code is not ErrorCode.UNAVAILABLE
            raise error from None
        self._reachable = True
        return reply

    def _fetch_info(self, wait_for_ready: bool = False) -> StoreInfo:
        """``wait_for_ready``: ride out the channel's reconnect backoff (a store that just
        restarted) for up to ``timeout_s``, instead of failing at once."""
        if wait_for_ready:
            try:
                reply = self._stub.Info(
                    pb.InfoRequest(), timeout=self.timeout_s, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                raise rpc.error_from_rpc(exc, f"store {self.address}") from None
        else:
            reply = self._call("Info", pb.InfoRequest())
        info = StoreInfo(
            node_id=reply.node_id,
            epoch=reply.epoch,
            segment_name=reply.segment_name,
            segment_size=reply.segment_size,
            page_size=reply.page_size,
            version=reply.version,
            transfer_address=reply.transfer_address,
            transfer_base=reply.transfer_base,
            lease_ttl_s=reply.lease_ttl_s or 30.0,
            control_socket=reply.control_socket,
            view_offset=reply.view_offset,
            view_bytes=reply.view_bytes,
            session_timeout_s=reply.session_timeout_s,
        )
        self._local.adopt(info)
        if self._local.control is not None:
            self._reachable = True
        return info

    # -- StoreClient: the engine's surface --------------------------------------------------

    def info(self) -> StoreInfo:
        """The incarnation this client is attached to (attaching now if it was not yet:
        UNAVAILABLE while the store cannot be reached)."""
        info = self._info
        if info is None:
            info = self._info = self._fetch_info()
        return info

    def register_namespace(self, namespace: Namespace, chunk_bytes: int) -> bytes:
        reply = self._call(
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(
                epoch=self.epoch,
                namespace_json=namespace.model_dump_json(),
                chunk_bytes=chunk_bytes,
            ),
        )
        self._local.registered(reply.ns_id, self.epoch)
        return reply.ns_id

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        epoch = self.epoch  # the reply's extents belong to the epoch the request was made in
        if self.known_miss(ns_id, keys):  # no round trip
            return LookupResult([], LookupStatus.MISS, 0, epoch)
        if lease_ttl_s and not session and self._local.leases_here:
            own = self._own.get()
            answered = self._local.view_lease(ns_id, keys, epoch, own, lease_ttl_s)
            if answered is not None:  # pinned here, no round trip
                return answered
        packed = pack_keys(keys)

        def call(session: int) -> Any:
            request = pb.LookupRequest(
                epoch=epoch,
                ns_id=ns_id,
                keys=packed,
                lease_ttl_s=lease_ttl_s or 0,
                session=session,
            )
            return self._call("Lookup", request)

        reply = self._own.run(session, call) if lease_ttl_s else call(0)
        return LookupResult(
            wire.locations_from_pb(reply.hits),
            wire.LOOKUP_STATUS_BACK[reply.stop],
            reply.lease_id,
            epoch,
            reply.lease_ttl_s,
        )

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
        *,
        session: int = 0,
    ) -> AllocateResult:
        if any(size < 0 for size in sizes):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "chunk sizes must be >= 0")
        epoch = self.epoch
        packed = pack_keys(keys)

        def call(session: int) -> Any:
            request = pb.AllocateRequest(
                epoch=epoch,
                ns_id=ns_id,
                keys=packed,
                sizes=sizes,
                ttl_s=ttl_s or 0,
                session=session,
            )
            return self._call("Allocate", request)

        return wire.allocated_from_pb(self._own.run(session, call), epoch)

    def allocate_many(
        self, calls: Sequence[AllocateCall], *, session: int = 0
    ) -> list[AllocateResult | KvtierError]:
        """On the control socket: every allocation in one message (one round trip)."""
        control = self._local.control
        if control is None or len(calls) < 2:
            return super().allocate_many(calls, session=session)
        epoch = self.epoch
        for call in calls:
            if any(size < 0 for size in call.sizes):
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, "chunk sizes must be >= 0")

        def send(session: int) -> list[Any]:
            requests = [
                pb.AllocateRequest(
                    epoch=epoch,
                    ns_id=c.ns_id,
                    keys=pack_keys(c.keys),
                    sizes=c.sizes,
                    session=session,
                )
                for c in calls
            ]
            try:
                replies = control.batch([("Allocate", r) for r in requests])
            except ControlUnreachable:
                raise KvtierError(ErrorCode.UNAVAILABLE, "control socket: no answer") from None
            first_error = next((r for r in replies if isinstance(r, KvtierError)), None)
            if first_error is not None and first_error.code is ErrorCode.UNKNOWN_SESSION:
                raise first_error  # the session is reopened and the batch sent again
            return replies

        try:
            replies = self._own.run(session, send)
        except KvtierError as exc:
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
            return super().allocate_many(calls, session=session)  # over gRPC, call by call
        parse = wire.allocated_from_pb
        return [r if isinstance(r, KvtierError) else parse(r, epoch) for r in replies]

    def commit_many(self, calls: Sequence[CommitCall]) -> list[int | KvtierError]:
        control = self._local.control
        if control is None or len(calls) < 2:
            return super().commit_many(calls)
        requests = [
            wire.commit_request(self.epoch, c.lease_id, c.keys, c.checksums, c.as_ns_id, c.as_keys)
            for c in calls
        ]
        try:
            replies = control.batch([("Commit", r) for r in requests])
        except ControlUnreachable:
            return super().commit_many(calls)  # over gRPC, which answers or says why
        return [r if isinstance(r, KvtierError) else r.committed for r in replies]

    def commit(
        self,
        lease_id: int,
        keys: Sequence[bytes] | None,
        checksums: Sequence[int],
        *,
        as_ns_id: bytes = b"",
        as_keys: Sequence[bytes] | None = None,
    ) -> int:
        request = wire.commit_request(self.epoch, lease_id, keys, checksums, as_ns_id, as_keys)
        return self._call("Commit", request).committed

    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int:
        request = pb.AbortRequest(
            epoch=self.epoch, lease_id=lease_id, keys=pack_keys(keys) if keys else b""
        )
        return self._call("Abort", request).aborted

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        mine = [i for i in lease_ids if view_leases.owns(i)]
        if not mine:
            return self._release_at_store(lease_ids)
        local = iter(self._local.release_view_leases(mine))
        others = [i for i in lease_ids if not view_leases.owns(i)]
        remote = iter(self._release_at_store(others) if others else [])
        return [next(local) if view_leases.owns(i) else next(remote) for i in lease_ids]

    def _release_at_store(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        reply = self._call("Release", pb.ReleaseRequest(epoch=self.epoch, lease_ids=lease_ids))
        return [wire.LEASE_STATUS_BACK[s] for s in reply.statuses]

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        if view_leases.owns(lease_id):
            return self._local.renew_view_lease(lease_id, ttl_s or self.info().lease_ttl_s)
        request = pb.RenewRequest(epoch=self.epoch, lease_id=lease_id, ttl_s=ttl_s or 0)
        return self._call("Renew", request).ttl_s

    # -- sessions ----------------------------------------------------------------------------

    def open_session(self) -> int:
        """A new session at the store, for the caller to heartbeat and close itself (the
        client's own session, used when no ``session=`` is given, needs none of this)."""
        return self._call("OpenSession", pb.OpenSessionRequest(epoch=self.epoch)).session

    def heartbeat(self, session: int) -> bool:
        request = pb.HeartbeatRequest(epoch=self.epoch, session=session)
        return self._call("Heartbeat", request).alive

    def close_session(self, session: int) -> int:
        request = pb.CloseSessionRequest(epoch=self.epoch, session=session)
        return self._call("CloseSession", request).released

    def known_miss(self, ns_id: bytes, keys: Sequence[bytes], with_disk: bool = False) -> bool:
        info = self._info
        return info is not None and self._local.known_miss(ns_id, keys, info.epoch, with_disk)

    def open_own_session(self) -> int:
        """This client's session, opened now if it is not yet (it opens by itself on the first
        lease-creating call; a lookup the store's view answers creates none). 0: the store
        has no sessions."""
        return self._own.get()

    def _open_own_session_at_store(self) -> tuple[int, float]:
        """OpenSession for this client's own session (``OwnSession``): (id, timeout)."""
        # leasing here, the session gets its pin-table row as it opens: no first hit
        # goes to the store for it
        request = pb.OpenSessionRequest(epoch=self.epoch, view_leases=self._local.leases_here)
        reply = self._call("OpenSession", request)
        return reply.session, reply.timeout_s

    def _count_ended(self) -> None:
        self.sessions_ended += 1  # under the session's lock (``OwnSession.drop``)

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        request = pb.DeleteRequest(epoch=self.epoch, ns_id=ns_id, keys=pack_keys(keys))
        return self._call("Delete", request).deleted

    def fetch(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        holder: str,
        timeout_s: float | None = None,
    ) -> FetchResult:
        if timeout_s is not None and not timeout_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"fetch timeout must be > 0: {timeout_s}")
        request = pb.FetchRequest(
            epoch=self.epoch,
            ns_id=ns_id,
            keys=pack_keys(keys),
            holder=holder,
            timeout_s=timeout_s or 0,
        )
        # The store bounds the fetch itself; this deadline only catches a store that hangs.
        wait = (timeout_s or 30.0) + FETCH_REPLY_MARGIN_S
        return wire.fetch_from_pb(self._call("Fetch", request, timeout=wait))

    def stage_from_disk(self, ns_id: bytes, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        if not timeout_s > 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"stage timeout must be > 0: {timeout_s}")
        request = pb.StageFromDiskRequest(
            epoch=self.epoch, ns_id=ns_id, keys=pack_keys(keys), timeout_s=timeout_s
        )
        # The store bounds the stage itself (plus one file read); this only catches a hang.
        wait = timeout_s + FETCH_REPLY_MARGIN_S
        return wire.fetch_from_pb(self._call("StageFromDisk", request, timeout=wait))

    # -- StoreAdmin: operators, the index, peer stores -------------------------------------

    def clear(self) -> int:
        return self._call("Clear", pb.ClearRequest(epoch=self.epoch)).cleared

    def stats(self) -> dict[str, int | float | str]:
        return json.loads(self._call("Stats", pb.StatsRequest()).stats_json)

    def snapshot(self) -> Snapshot:
        reply = self._call("Snapshot", pb.SnapshotRequest())
        return Snapshot(
            reply.seq,
            {c.ns_id: unpack_keys(c.keys) for c in reply.chunks},
            {c.ns_id: unpack_keys(c.keys) for c in reply.disk_chunks},
        )

    def read_events(
        self, from_seq: int, max_batches: int = 256, timeout: float | None = None
    ) -> list[EventBatch] | EventGap:
        reply = self._call(
            "ReadEvents",
            pb.ReadEventsRequest(
                from_seq=from_seq, max_batches=max_batches, timeout_s=timeout or 0
            ),
            timeout=(timeout or 0) + self.timeout_s,
        )
        if reply.gap_oldest:
            return EventGap(requested=from_seq, oldest=reply.gap_oldest)
        return [wire.batch_from_pb(b) for b in reply.batches]

    def lease_for_peer(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease_ttl_s: float | None = None,
        timeout_s: float | None = None,
        *,
        session: int = 0,
    ) -> LookupResult:
        epoch = self.epoch
        packed = pack_keys(keys)

        def call(session: int) -> Any:
            request = pb.LookupRequest(
                epoch=epoch,
                ns_id=ns_id,
                keys=packed,
                lease_ttl_s=lease_ttl_s or 0,
                session=session,
            )
            return self._call("LeaseForPeer", request, timeout=timeout_s)

        reply = self._own.run(session, call)
        return LookupResult(
            wire.locations_from_pb(reply.hits),
            wire.LOOKUP_STATUS_BACK[reply.stop],
            reply.lease_id,
            epoch,
            reply.lease_ttl_s,
        )

    def close(self) -> None:
        """End the client's session (its leases with it) and close the channel. Idempotent."""
        if self._own.closed.is_set():
            return
        session = self._own.close()
        if session and self._reachable:  # a store not answering ends it by timeout instead
            with contextlib.suppress(KvtierError):
                request = pb.CloseSessionRequest(epoch=self.epoch, session=session)
                timeout = min(self.timeout_s, CLOSE_SESSION_TIMEOUT_S)
                self._call("CloseSession", request, timeout=timeout)
        self._local.close()
        self._channel.close()  # a heartbeat in flight is cancelled; the thread then stops
