"""Control-plane clients of peer stores, by gRPC address, shared by fetches and demotion.

A client is created on first use (one ``Info`` call), kept while the peer answers, dropped
when it does not (the next use reconnects), and re-attached when the peer restarted
(STALE_EPOCH). Namespaces are registered at a peer once per peer epoch.

Threading: thread-safe; clients are shared (gRPC channels are).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kvtier.errors import ErrorCode, KvtierError
from kvtier.keys import Namespace
from kvtier.rpc import ClientAuth
from kvtier.store.client.grpc import GrpcStoreClient

T = TypeVar("T")


class PeerClients:
    def __init__(self, rpc_timeout_s: float, auth: ClientAuth | None = None) -> None:
        """``auth``: what this store presents to its peers (a node credential)."""
        self.rpc_timeout_s = rpc_timeout_s
        self.auth = auth
        self._lock = threading.Lock()
        self._clients: dict[str, GrpcStoreClient] = {}
        self._registered: set[tuple[str, int, bytes]] = set()  # (address, epoch, ns_id)

    def get(self, address: str) -> GrpcStoreClient:
        """The client of the store at ``address`` (raises UNAVAILABLE if it does not answer)."""
        with self._lock:
            client = self._clients.get(address)
        if client is not None:
            return client
        client = GrpcStoreClient(address, timeout_s=self.rpc_timeout_s, auth=self.auth)
        with self._lock:
            existing = self._clients.setdefault(address, client)
        if existing is not client:
            client.close()
        return existing

    def drop(self, address: str) -> None:
        with self._lock:
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    def call(
        self,
        address: str,
        namespace: tuple[bytes, Namespace, int] | None,
        fn: Callable[[GrpcStoreClient], T],
    ) -> T:
        """Run ``fn(client)`` against the peer, with ``namespace`` (id, namespace, chunk bytes)
        registered there first. A peer restart (STALE_EPOCH) or a namespace it lost is repaired
        once; an unreachable peer's client is dropped. KvtierErrors propagate."""
        for attempt in (0, 1):
            client = self.get(address)
            try:
                if namespace is not None:
                    self._ensure_namespace(address, client, namespace)
                return fn(client)
            except KvtierError as exc:
                if attempt == 0 and exc.code is ErrorCode.STALE_EPOCH:
                    try:
                        client.reattach()
                    except KvtierError:
                        self.drop(address)
                        raise exc from None
                    continue
                if attempt == 0 and exc.code is ErrorCode.UNKNOWN_NAMESPACE and namespace:
                    with self._lock:
                        self._registered.discard((address, client.epoch, namespace[0]))
                    continue
                if exc.code is ErrorCode.UNAVAILABLE:
                    self.drop(address)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _ensure_namespace(
        self, address: str, client: GrpcStoreClient, namespace: tuple[bytes, Namespace, int]
    ) -> None:
        ns_id, ns, chunk_bytes = namespace
        tag = (address, client.epoch, ns_id)
        with self._lock:
            if tag in self._registered:
                return
        got = client.register_namespace(ns, chunk_bytes)
        if got != ns_id:
            raise KvtierError(ErrorCode.NAMESPACE_MISMATCH, "peer computed another namespace id")
        with self._lock:
            self._registered.add(tag)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
