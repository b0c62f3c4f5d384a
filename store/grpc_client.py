"""``StoreClient`` over gRPC, for processes that map the pool of a ``kvtier store serve``.

The client remembers the store epoch it attached to and sends it with every request; after a
store restart every call fails with STALE_EPOCH until the caller re-attaches (``reattach``),
so a client can never apply offsets from one pool incarnation to another.

Threading: thread-safe (one channel, gRPC stubs are thread-safe).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace, pack_keys, unpack_keys
from kvtier.store import wire
from kvtier.store.api import StoreClient, StoreInfo
from kvtier.store.events import EventBatch, EventGap
from kvtier.store.leases import LeaseStatus
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc
from kvtier.store.types import AllocateResult, LookupResult, Snapshot
from kvtier.tiers.remote.types import FetchResult

# A fetch's reply may come this long after its own deadline (the store's last control call).
FETCH_REPLY_MARGIN_S = 5.0


class GrpcStoreClient(StoreClient):
    def __init__(self, address: str, timeout_s: float = 10.0, lazy: bool = False) -> None:
        """``lazy``: do not fail when the store is not reachable yet (an engine may start
        before its node store); every call then answers UNAVAILABLE until it is."""
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.enable_http_proxy", 0),
                # a channel of its own: a new client of a restarted server connects at once
                # instead of inheriting a shared subchannel's reconnect backoff (up to 120 s)
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        self._stub = store_pb2_grpc.StoreStub(self._channel)
        self._info: StoreInfo | None = None
        try:
            self._info = self._fetch_info()
        except KvtierError as exc:
            if not lazy or exc.code is not ErrorCode.UNAVAILABLE:
                raise  # lazy: a store not up yet is attached to on first use

    @property
    def epoch(self) -> int:
        return self.info().epoch

    def reattach(self) -> StoreInfo:
        """Adopt the store's current epoch (after STALE_EPOCH). Returns the new info."""
        self._info = self._fetch_info()
        return self._info

    def _call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, name)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as exc:
            raise wire.error_from_rpc(exc) from None

    def _fetch_info(self) -> StoreInfo:
        reply = self._call("Info", pb.InfoRequest())
        return StoreInfo(
            node_id=reply.node_id,
            epoch=reply.epoch,
            segment_name=reply.segment_name,
            segment_size=reply.segment_size,
            page_size=reply.page_size,
            version=reply.version,
            transfer_address=reply.transfer_address,
            transfer_base=reply.transfer_base,
        )

    # -- StoreClient -------------------------------------------------------------------------

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
        return reply.ns_id

    def lookup(
        self, ns_id: bytes, keys: Sequence[bytes], lease_ttl_s: float | None = None
    ) -> LookupResult:
        epoch = self.epoch  # the reply's extents belong to the epoch the request was made in
        reply = self._call(
            "Lookup",
            pb.LookupRequest(
                epoch=epoch, ns_id=ns_id, keys=pack_keys(keys), lease_ttl_s=lease_ttl_s or 0
            ),
        )
        return LookupResult(
            wire.locations_from_pb(reply.hits),
            wire.LOOKUP_STATUS_BACK[reply.stop],
            reply.lease_id,
            epoch,
        )

    def allocate(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        ttl_s: float | None = None,
    ) -> AllocateResult:
        if any(size < 0 for size in sizes):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "chunk sizes must be >= 0")
        epoch = self.epoch
        reply = self._call(
            "Allocate",
            pb.AllocateRequest(
                epoch=epoch, ns_id=ns_id, keys=pack_keys(keys), sizes=sizes, ttl_s=ttl_s or 0
            ),
        )
        statuses = [wire.ALLOC_STATUS_BACK[s] for s in reply.statuses]
        allocated = iter(wire.locations_from_pb(reply.allocated))
        locations = [next(allocated) if s.value == "allocated" else None for s in statuses]
        return AllocateResult(reply.lease_id, statuses, locations, epoch)

    def commit(self, lease_id: int, keys: Sequence[bytes] | None, checksums: Sequence[int]) -> int:
        request = pb.CommitRequest(
            epoch=self.epoch,
            lease_id=lease_id,
            keys=pack_keys(keys) if keys is not None else b"",
            checksums=checksums,
        )
        return self._call("Commit", request).committed

    def abort(self, lease_id: int, keys: Sequence[bytes] | None = None) -> int:
        request = pb.AbortRequest(
            epoch=self.epoch, lease_id=lease_id, keys=pack_keys(keys) if keys else b""
        )
        return self._call("Abort", request).aborted

    def release(self, lease_ids: Sequence[int]) -> list[LeaseStatus]:
        reply = self._call("Release", pb.ReleaseRequest(epoch=self.epoch, lease_ids=lease_ids))
        return [wire.LEASE_STATUS_BACK[s] for s in reply.statuses]

    def renew(self, lease_id: int, ttl_s: float | None = None) -> float:
        request = pb.RenewRequest(epoch=self.epoch, lease_id=lease_id, ttl_s=ttl_s or 0)
        return self._call("Renew", request).ttl_s

    def delete(self, ns_id: bytes, keys: Sequence[bytes]) -> int:
        request = pb.DeleteRequest(epoch=self.epoch, ns_id=ns_id, keys=pack_keys(keys))
        return self._call("Delete", request).deleted

    def clear(self) -> int:
        return self._call("Clear", pb.ClearRequest(epoch=self.epoch)).cleared

    def stats(self) -> dict[str, int | float | str]:
        return json.loads(self._call("Stats", pb.StatsRequest()).stats_json)

    def snapshot(self) -> Snapshot:
        reply = self._call("Snapshot", pb.SnapshotRequest())
        return Snapshot(reply.seq, {c.ns_id: unpack_keys(c.keys) for c in reply.chunks})

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
    ) -> LookupResult:
        epoch = self.epoch
        reply = self._call(
            "LeaseForPeer",
            pb.LookupRequest(
                epoch=epoch, ns_id=ns_id, keys=pack_keys(keys), lease_ttl_s=lease_ttl_s or 0
            ),
            timeout=timeout_s,
        )
        return LookupResult(
            wire.locations_from_pb(reply.hits),
            wire.LOOKUP_STATUS_BACK[reply.stop],
            reply.lease_id,
            epoch,
        )

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

    def stream(self, from_seq: int = 1):  # -> Iterator[EventBatch | EventGap]
        """A long-lived event stream from ``from_seq``; ends with an EventGap or store exit."""
        call = self._stub.Subscribe(pb.SubscribeRequest(from_seq=from_seq))
        try:
            for reply in call:
                if reply.gap_oldest:
                    yield EventGap(requested=from_seq, oldest=reply.gap_oldest)
                    return
                yield wire.batch_from_pb(reply.batch)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise wire.error_from_rpc(exc) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()
