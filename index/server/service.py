"""``kvtier index serve``: the index as a process (gRPC + HTTP + followers), and ``connect()``.

``connect(config)`` is what every consumer uses: a ``GrpcIndexClient`` of the index at
``index.address``, or, when no address is configured, an ``EmbeddedIndex``: the configured
backend and followers in this process, behind the same ``ChunkIndex`` interface.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.core import rpc
from kvtier.core.auth import Authenticator, check_exposure, tenant_salts
from kvtier.core.config import KvtierConfig
from kvtier.core.config.auth import AuthConfig
from kvtier.core.config.index import IndexConfig
from kvtier.core.http import HttpGuard, HttpServer
from kvtier.index.api import ChunkIndex, ForwardingIndex, IndexHealth
from kvtier.index.client import connect  # noqa: F401 - kvtier.index.server.service.connect, kept
from kvtier.index.ingest.manager import IngestManager, ResyncGate
from kvtier.index.server.access import IndexAccess
from kvtier.index.server.feed import ChangeFeed, FeedingIndex
from kvtier.index.server.grpc import INDEX_PERMISSIONS, start_grpc_server
from kvtier.index.server.http import build_app, location_json
from kvtier.index.server.metrics import build_registry

log = logging.getLogger(__name__)


def build_backend(config: IndexConfig) -> ChunkIndex:
    if config.backend == "redis-cluster":
        from kvtier.index.backends.redis_cluster import RedisClusterIndex

        return RedisClusterIndex(
            config.redis_url,
            config.redis_prefix,
            config.redis_timeout_s,
            max_namespaces=config.max_namespaces,
            max_claim_ttl_s=config.max_claim_ttl_s,
            shards=config.redis_shards,
            placement=config.redis_placement,
        )
    if config.backend == "redis":
        from kvtier.index.backends.redis import RedisIndex

        return RedisIndex(
            config.redis_url,
            config.redis_prefix,
            config.redis_timeout_s,
            max_namespaces=config.max_namespaces,
            max_claim_ttl_s=config.max_claim_ttl_s,
        )
    from kvtier.index.backends.memory import MemoryIndex

    return MemoryIndex(max_namespaces=config.max_namespaces)


def tune_gc() -> None:
    """The index holds millions of small long-lived objects; the default collector would
    rescan them all every few thousand allocations. Move what exists to the permanent
    generation and collect the young one less often (the hot paths allocate in bursts)."""
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


class EmbeddedIndex(ForwardingIndex):
    """The index in this process: a backend plus the followers of the configured sources."""

    def __init__(self, config: IndexConfig, backend: ChunkIndex | None = None) -> None:
        super().__init__(backend if backend is not None else build_backend(config))
        self.ingest = IngestManager(self.inner, config)
        self.ingest.start()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "sources": [s.snapshot() for s in self.ingest.sources()]}

    def health(self) -> tuple[IndexHealth, str]:
        return self.ingest.readiness(self.inner.health())

    def close(self) -> None:
        self.ingest.stop()
        self.inner.close()


@dataclass
class IndexService:
    """A running index: backend + followers + metrics + gRPC + HTTP."""

    config: IndexConfig
    backend: ChunkIndex
    ingest: IngestManager
    grpc_server: grpc.Server
    http: HttpServer
    grpc_address: str
    http_address: str

    @classmethod
    def start(
        cls,
        config: IndexConfig,
        backend: ChunkIndex | None = None,
        auth: AuthConfig | None = None,
        tenants: Mapping[str, Iterable[str]] | None = None,
    ) -> IndexService:
        """``auth``: who may call the index, and what it presents to the stores it follows
        (once they proved a node credential of ``auth``). ``tenants``: tenant name -> salt
        digests (``tenant_salts(store.tenants)``), what an engine's ``tenants`` limit it to;
        without them such an engine sees no namespace at all."""
        auth = auth or AuthConfig()
        check_exposure("kvtier index", [config.grpc_host, config.http_host], auth)
        tenants = tenants or {}
        authenticator = Authenticator(auth, tenants)
        security = rpc.ServerSecurity(
            authenticator, INDEX_PERMISSIONS, auth.tls if auth.tls.enabled else None
        )
        backend = backend if backend is not None else build_backend(config)
        # every write, the followers' and the API's, passes the change feed first
        feeding = None
        if config.feed_changes:
            backend = feeding = FeedingIndex(backend, ChangeFeed(config.feed_changes))
        ingest: IngestManager | None = None
        try:
            ingest = IngestManager(
                backend,
                config,
                rpc.ClientAuth.from_config(auth),
                verify=authenticator,
                owners={name: p.salts for name, p in authenticator.by_name.items()},
            )
            # health (readiness, metrics, stats) says "resyncing" until the sources have
            # resent their state after the backend lost its data
            gate = ResyncGate(backend, ingest)
            metered, registry = build_registry(gate, ingest.sources, ingest.resyncing)
            ingest.index = metered  # followers' writes are timed too

            def stats() -> dict[str, Any]:
                return _stats(metered, ingest)

            access = IndexAccess(metered, config)
            server, grpc_port = start_grpc_server(
                access,
                stats,
                config.grpc_host,
                config.grpc_port,
                config.grpc_workers,
                security=security,
                feeding=feeding,
            )
            started = threading.Event()
            http = HttpServer(
                build_app(
                    access,
                    registry,
                    stats,
                    started.is_set,
                    HttpGuard(authenticator),
                    auth.metrics_public,
                ),
                config.http_host,
                config.http_port,
                tls=security.tls,
            )
            http_port = http.start()
            ingest.start()
        except BaseException:
            if ingest is not None:
                ingest.stop()
            backend.close()
            raise
        started.set()
        return cls(
            config,
            backend,
            ingest,
            server,
            http,
            f"{config.grpc_host}:{grpc_port}",
            f"{config.http_host}:{http_port}",
        )

    def stop(self, grace_s: float = 2.0) -> None:
        self.ingest.stop()
        self.grpc_server.stop(grace_s).wait()
        self.http.stop()
        self.backend.close()


def _stats(index: ChunkIndex, ingest: IngestManager) -> dict[str, Any]:
    health, reason = index.health()
    out: dict[str, Any] = {"health": health.value, "health_reason": reason}
    try:
        out["backend"] = index.stats()
        out["locations"] = [location_json(i) for i in index.locations()]
    except Exception as exc:  # degraded: say what is known
        out["backend_error"] = str(exc)
    out["sources"] = [s.snapshot() for s in ingest.sources()]
    out["reaped"] = dict(ingest.reaped)
    out["unfollowed"] = ingest.unfollowed  # registrations past max_dynamic_followers
    return out


def serve(config: KvtierConfig) -> None:
    """Run the index until SIGINT/SIGTERM. Prints one JSON 'ready' line on stdout."""
    service = IndexService.start(
        config.index, auth=config.auth, tenants=tenant_salts(config.store.tenants)
    )
    tune_gc()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    health, _ = service.backend.health()
    print(
        json.dumps(
            {
                "event": "ready",
                "grpc": service.grpc_address,
                "http": service.http_address,
                "backend": config.index.backend,
                "health": health.value,
                "replica": config.index.replica_id,
                "sources": len(config.index.vllm) + len(config.index.stores),
                "started": time.time(),
            }
        ),
        flush=True,
    )
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        service.stop()
        print(json.dumps({"event": "stopped"}), flush=True)
        sys.stdout.flush()
