"""``kvtier store serve``: one process per node owning the pool, serving gRPC and HTTP.

Clients connect with ``kvtier.store.client.connect`` (the control API) or
``kvtier.tiers.connect`` (the pool as a tier); ``connect`` here is a deprecated alias.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtier.core import rpc
from kvtier.core.auth import Authenticator, check_exposure, tenant_salts
from kvtier.core.config import AuthConfig, KvtierConfig, StoreConfig
from kvtier.core.http import HttpGuard, HttpServer
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.announce import Announcer
from kvtier.store.client.control import socket_path
from kvtier.store.node import NodeStore
from kvtier.store.server.control import ControlServer
from kvtier.store.server.grpc import STORE_PERMISSIONS, StoreServicer, start_grpc_server
from kvtier.store.server.http import build_app
from kvtier.store.server.metrics import build_registry

log = logging.getLogger(__name__)


@dataclass
class StoreService:
    """A running store: NodeStore + metrics + gRPC + HTTP. ``stop()`` shuts it down cleanly."""

    node: NodeStore
    grpc_server: grpc.Server
    http: HttpServer
    grpc_address: str
    http_address: str
    announcer: Announcer | None = None
    control: ControlServer | None = None  # the engines' hot path (store.fast_control)

    @classmethod
    def start(
        cls,
        config: StoreConfig,
        index_address: str | None = None,
        auth: AuthConfig | None = None,
    ) -> StoreService:
        """``index_address``: announce this store there (the index then follows its events).
        ``auth``: who may call it, and what it presents to the index and its peers."""
        auth = auth or AuthConfig()
        check_exposure("kvtier store", [config.grpc_host, config.http_host], auth)
        authenticator = Authenticator(auth, tenant_salts(config.tenants))
        security = rpc.ServerSecurity(
            authenticator,
            STORE_PERMISSIONS,
            auth.tls if auth.tls.enabled else None,
            own_token=auth.client_token(),
        )
        client_auth = rpc.ClientAuth.from_config(auth)
        index_address = index_address or config.index_address
        # Port 0 (pick a free one) is not an identity; the pid is.
        instance = f"port{config.grpc_port}" if config.grpc_port else f"pid{os.getpid()}"
        node = NodeStore(
            config,
            instance=instance,
            peer_auth=client_auth,
            peer_verify=authenticator,
            index_address=index_address,
        )
        control: ControlServer | None = None
        try:
            metrics, registry = build_registry(node)
            if node.disk is not None:
                file_latency = metrics.disk_file_latency
                node.disk.on_file_timed = lambda op, s: file_latency.labels(op).observe(s)
            servicer = StoreServicer(node, security.own_token, metrics=metrics)
            control = start_control(node, servicer, authenticator)
            server, grpc_port = start_grpc_server(
                node,
                config.grpc_host,
                config.grpc_port,
                config.grpc_workers,
                security=security,
                unix_socket=config.unix_socket,
                max_message_bytes=int(config.max_message_bytes),
                metrics=metrics,
                servicer=servicer,
            )
            ready = threading.Event()
            http = HttpServer(
                build_app(
                    node,
                    registry,
                    lambda: ready.is_set() and not node.closed,
                    HttpGuard(authenticator),
                    auth.metrics_public,
                ),
                config.http_host,
                config.http_port,
                tls=security.tls,
            )
            http_port = http.start()
        except BaseException:
            if control is not None:
                control.stop()
            node.close()
            raise
        ready.set()
        grpc_address = config.advertise_address or f"{config.grpc_host}:{grpc_port}"
        if not config.advertise_address and config.grpc_host in ("0.0.0.0", "::", "[::]", ""):
            grpc_address = f"{config.remote.hostname}:{grpc_port}"  # what peers can reach
        node.start_remote(grpc_address)
        announcer = None
        if index_address:  # then the index follows this store without being told
            announcer = Announcer(
                index_address,
                Registration(config.node_id, LocationKind.NODE, endpoints={"store": grpc_address}),
                auth=client_auth,
            )
        return cls(
            node,
            server,
            http,
            grpc_address,
            f"{config.http_host}:{http_port}",
            announcer,
            control,
        )

    def stop(self, grace_s: float = 2.0) -> None:
        if self.announcer is not None:
            self.announcer.stop()
        self.node.core.events.close()  # end ReadEvents long-polls so the grace period is short
        if self.control is not None:
            self.control.stop()
        self.grpc_server.stop(grace_s).wait()
        self.http.stop()
        self.node.close()


def start_control(
    node: NodeStore, servicer: StoreServicer, authenticator: Authenticator
) -> ControlServer | None:
    """The control socket, when ``store.fast_control`` is on and its path fits a socket
    address (else engines use gRPC, with a warning here)."""
    if not node.config.fast_control:
        return None
    path = socket_path(Path(node.config.run_dir), node.epoch)
    if path is None:
        log.warning(
            "store.run_dir %s is too long a path for a Unix socket: engines use gRPC for "
            "every call (set a shorter run_dir for the control socket)",
            node.config.run_dir,
        )
        return None
    control = ControlServer(servicer, path, authenticator)
    node.control_socket = str(path)
    node.control_stats = control.stats
    return control


def serve(config: KvtierConfig) -> None:
    """Run a store until SIGINT/SIGTERM. Prints one JSON 'ready' line on stdout."""
    service = StoreService.start(config.store, config.index.address, config.auth)
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
                "unix": f"unix:{config.store.unix_socket}" if config.store.unix_socket else None,
                "http": service.http_address,
                "segment": info.segment_name,
                "capacity_bytes": service.node.core.capacity_bytes,
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
