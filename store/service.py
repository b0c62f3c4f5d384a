"""``kvtier store serve``: one process per node owning the pool, serving gRPC and HTTP.

Also ``connect()``, which every client uses: a ``CpuTier`` on the store at
``store.address``, or on an embedded in-process store when no address is configured.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import grpc

from kvtier.config import KvtierConfig, StoreConfig
from kvtier.index.announce import Announcer
from kvtier.index.api import LocationKind, Registration
from kvtier.store.grpc_client import GrpcStoreClient
from kvtier.store.grpc_server import start_grpc_server
from kvtier.store.http import HttpServer, build_app
from kvtier.store.metrics import build_registry
from kvtier.store.node import NodeStore
from kvtier.tiers.cpu.tier import CpuTier

log = logging.getLogger(__name__)


def connect(
    config: StoreConfig, timeout_s: float = 10.0, max_namespaces: int = 4096, lazy: bool = False
) -> CpuTier:
    """The CPU tier of this node: the configured store, or an embedded one. ``timeout_s``
    bounds each control call to a served store; ``lazy`` tolerates one not up yet."""
    if config.address:
        client = GrpcStoreClient(config.address, timeout_s, lazy=lazy)
        return CpuTier(client, max_namespaces=max_namespaces)
    node = NodeStore(config)
    return CpuTier(node, segment=node.segment, max_namespaces=max_namespaces)


@dataclass
class StoreService:
    """A running store: NodeStore + metrics + gRPC + HTTP. ``stop()`` shuts it down cleanly."""

    node: NodeStore
    grpc_server: grpc.Server
    http: HttpServer
    grpc_address: str
    http_address: str
    announcer: Announcer | None = None

    @classmethod
    def start(cls, config: StoreConfig) -> StoreService:
        # Port 0 (pick a free one) is not an identity; the pid is.
        instance = f"port{config.grpc_port}" if config.grpc_port else f"pid{os.getpid()}"
        node = NodeStore(config, instance=instance)
        try:
            metered, registry = build_registry(node)
            server, grpc_port = start_grpc_server(
                metered, config.grpc_host, config.grpc_port, config.grpc_workers
            )
            ready = threading.Event()
            http = HttpServer(
                build_app(metered, registry, lambda: ready.is_set() and not node.closed),
                config.http_host,
                config.http_port,
            )
            http_port = http.start()
        except BaseException:
            node.close()
            raise
        ready.set()
        grpc_address = config.advertise_address or f"{config.grpc_host}:{grpc_port}"
        if not config.advertise_address and config.grpc_host in ("0.0.0.0", "::", "[::]", ""):
            grpc_address = f"{config.remote.hostname}:{grpc_port}"  # what peers can reach
        node.start_remote(grpc_address)
        announcer = None
        if config.index_address:  # then the index follows this store without being told
            announcer = Announcer(
                config.index_address,
                Registration(config.node_id, LocationKind.NODE, endpoints={"store": grpc_address}),
            )
        return cls(node, server, http, grpc_address, f"{config.http_host}:{http_port}", announcer)

    def stop(self, grace_s: float = 2.0) -> None:
        if self.announcer is not None:
            self.announcer.stop()
        self.node.core.events.close()  # end Subscribe streams so the grace period is short
        self.grpc_server.stop(grace_s).wait()
        self.http.stop()
        self.node.close()


def serve(config: KvtierConfig) -> None:
    """Run a store until SIGINT/SIGTERM. Prints one JSON 'ready' line on stdout."""
    service = StoreService.start(config.store)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    info = service.node.info()
    print(
        json.dumps(
            {
                "event": "ready",
                "node_id": info.node_id,
                "epoch": f"{info.epoch:016x}",
                "grpc": service.grpc_address,
                "http": service.http_address,
                "segment": info.segment_name,
                "capacity_bytes": info.segment_size,
                "transfer": info.transfer_address,
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
