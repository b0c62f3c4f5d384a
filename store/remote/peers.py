"""Control-plane clients of peer stores, by gRPC address, shared by fetches and demotion.

Only peers the ``PeerDirectory`` lists are dialed (the configured ones, the node stores the
index lists), and each proves it holds a node credential before this store's token is sent
there (``GrpcStoreClient(verify=...)``). Any address that is not listed, or a listed one that
does not answer or prove at first contact, gets one answer (``PeerUnavailable``): whoever
named it learns nothing of what listens there.

A client is created on first use (the proof, one ``Info`` call), kept while the peer answers,
dropped when it does not (the next use reconnects and proves again), and replaced when the
peer restarted (STALE_EPOCH: a new process at that address proves itself anew). Namespaces
are registered at a peer once per peer epoch.

Threading: thread-safe; clients are shared (gRPC channels are).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from kvtier.core.auth import Authenticator
from kvtier.core.config.auth import AuthConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.core.rpc import ClientAuth
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.remote.directory import PeerDirectory

log = logging.getLogger(__name__)  # debug only here: callers name addresses at will

T = TypeVar("T")

# What a holder this store will not (or cannot) talk to answers, whatever listens there.
NOT_A_PEER = "holder is not a known peer store, or it did not answer"


class PeerUnavailable(KvtierError):
    """No client for that address: not a known peer (nothing was dialed), or a known one that
    did not answer or did not prove a node credential at first contact. One message for all
    of them: the caller may have named the address, and must not learn what is there."""

    def __init__(self) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, NOT_A_PEER)


class PeerClients:
    def __init__(
        self,
        rpc_timeout_s: float,
        auth: ClientAuth | None = None,
        verify: Authenticator | None = None,
        directory: PeerDirectory | None = None,
    ) -> None:
        """``auth``: what this store presents to its peers (a node credential). ``verify``:
        checks a peer's proof of a node credential before that is sent (None: nothing can be
        checked, so a token is never sent). ``directory``: the peers this store may dial
        (None: none)."""
        self.rpc_timeout_s = rpc_timeout_s
        self.auth = auth
        self.verify = verify if verify is not None else Authenticator(AuthConfig())
        self.directory = directory if directory is not None else PeerDirectory()
        self._lock = threading.Lock()
        self._clients: dict[str, GrpcStoreClient] = {}
        self._registered: set[tuple[str, int, bytes]] = set()  # (address, epoch, ns_id)

    def get(self, address: str) -> GrpcStoreClient:
        """The client of the peer store at ``address``; ``PeerUnavailable`` when there is
        none (see the class)."""
        with self._lock:
            client = self._clients.get(address)
        if client is not None:
            return client
        if not self.directory.known(address):
            log.debug("refused to dial %.80r: not a known peer store", address)
            raise PeerUnavailable()
        try:
            client = GrpcStoreClient(
                address, timeout_s=self.rpc_timeout_s, auth=self.auth, verify=self.verify
            )
        except KvtierError as exc:
            log.debug("peer store %s: %s", address, exc)
            raise PeerUnavailable() from None
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
        once; an unreachable peer's client is dropped. KvtierErrors propagate (``get``'s
        ``PeerUnavailable`` among them)."""
        for attempt in (0, 1):
            client = self.get(address)
            try:
                if namespace is not None:
                    self._ensure_namespace(address, client, namespace)
                return fn(client)
            except KvtierError as exc:
                if attempt == 0 and exc.code is ErrorCode.STALE_EPOCH:
                    self.drop(address)  # a new process there: it proves itself first
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
