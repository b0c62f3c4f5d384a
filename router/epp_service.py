"""``kvtier router epp`` as a process: the endpoint picker (``router.epp.EndpointPicker``)
served over gRPC with its health service, instances, routing core and background loops.

Health: ``grpc.health.v1`` on the same port (and ``router.epp_health_port``): ``liveness``
always SERVING; ``""``, ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and
``inference-extension`` SERVING while some instance is healthy (all saturated still counts:
requests get 429).

Threading: one asyncio loop (grpc.aio) serves every stream and the health service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvtier.core.auth import Authenticator
from kvtier.core.config import KvtierConfig
from kvtier.core.config.auth import TlsConfig
from kvtier.core.config.router import RouterConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.index.api import ChunkIndex
from kvtier.router.backends import NoBackend
from kvtier.router.discovery import is_anonymous
from kvtier.router.epp import EndpointPicker
from kvtier.router.epp_wire import _NOT_SERVING, _SERVING, HEALTH_S, LIVENESS, READY_SERVICES
from kvtier.router.metrics import RouterMetrics
from kvtier.router.proxy import Proxy
from kvtier.router.service import Loops, make_core
from kvtier.router.tokenize import PromptTokenizer
from kvtier.router.upstream import UpstreamClients


class Epp:
    """An endpoint picker: instances, routing core, servicer, health and background loops,
    built as ``router.service.build`` builds the proxy's. Start it on a running loop."""

    def __init__(
        self,
        config: RouterConfig,
        index: ChunkIndex | None,
        probes: bool = True,
        authenticator: Authenticator | None = None,
        anonymous: bool | None = None,
    ) -> None:
        """``probes`` False: no background loops (refresh, scrape, probe), for tests;
        ``anonymous``: as ``router.service.build`` takes it."""
        self.config = config
        self.probes = probes
        self.metrics = RouterMetrics()
        if anonymous is None:
            anonymous = authenticator is None or not authenticator.enabled
        self.core = make_core(config, index, self.metrics, anonymous)
        self.backends = self.core.backends
        tokenizer = PromptTokenizer(config.model) if config.model else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s, read=config.probe_timeout_s, write=60, pool=None
        )
        self.upstream = UpstreamClients(limits, timeout)
        # the proxy is used for its tokenization only (/tokenize through self.upstream)
        prompts = Proxy(self.core, config, self.metrics, self.upstream, tokenizer, None)
        self.health = health_aio.HealthServicer()
        self.picker = EndpointPicker(
            self.core, config, self.metrics, prompts, authenticator, on_route=self._routed
        )
        self._servers: list[grpc.aio.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: bool | None = None

    async def start(
        self,
        host: str,
        port: int,
        health_port: int | None = None,
        tls: TlsConfig | None = None,
    ) -> tuple[int, int | None]:
        """Serve; returns (ext_proc port, health-only port or None). Port 0 picks one."""
        limit = self.config.max_body_bytes + (1 << 20)  # a BUFFERED body is one message
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"{host}:{port}"
        if tls is not None and tls.cert_file is not None and tls.key_file is not None:
            creds = grpc.ssl_server_credentials(
                [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
                root_certificates=tls.ca_file.read_bytes() if tls.ca_file else None,
                require_client_auth=tls.ca_file is not None,
            )
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
        if not bound:
            raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on {address}")
        self._servers.append(server)
        health_bound: int | None = None
        if health_port is not None:
            probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, probe)
            health_bound = probe.add_insecure_port(f"{host}:{health_port}")
            if not health_bound:
                raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on {host}:{health_port}")
            self._servers.append(probe)
        await self.health.set(LIVENESS, _SERVING)
        await self.update_health()
        for s in self._servers:
            await s.start()
        self._tasks.append(asyncio.create_task(self._follow_health()))
        if self.probes:
            loops = Loops(self.backends, self.config, self.metrics, self.upstream)
            self._tasks.append(asyncio.create_task(loops.run()))
        return bound, health_bound

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(s.stop(grace) for s in self._servers))
        await self.upstream.aclose()
        self.core.close()

    def ready(self) -> bool:
        """Some instance is healthy (all of them saturated still is: requests get 429)."""
        try:
            self.backends.routable()
        except NoBackend as exc:
            return exc.saturated
        return True

    async def update_health(self) -> None:
        ready = self.ready()
        if ready == self._ready:
            return
        self._ready = ready
        for service in READY_SERVICES:
            await self.health.set(service, _SERVING if ready else _NOT_SERVING)

    def _routed(self, found: bool) -> None:
        if found != self._ready:
            asyncio.get_running_loop().create_task(self.update_health())

    async def _follow_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_S)
            await self.update_health()


class EppServer:
    """An ``Epp`` on its own event loop in a background thread (tests, embedding)."""

    def __init__(self, epp: Epp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.epp = epp
        self.host, self._port = host, port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvtier-epp", daemon=True
        )

    def start(self, timeout: float = 10.0) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.epp.start(self.host, self._port), self._loop)
        self.port = future.result(timeout)[0]
        return self.port

    def stop(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self.epp.stop(0.5), self._loop)
        try:
            future.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


def serve(config: KvtierConfig) -> None:
    """Run the endpoint picker until SIGINT/SIGTERM. Prints a JSON ready line."""
    from kvtier.core.auth import check_exposure
    from kvtier.core.rpc import ClientAuth
    from kvtier.router.service import router_index

    rc = config.router
    # It decides where GPU time goes: off loopback it needs credentials (requests then carry
    # a client token, checked here) or mTLS.
    check_exposure("kvtier router epp", [rc.epp_host], config.auth)
    auth = ClientAuth.from_config(config.auth)
    index = router_index(config, auth)
    epp = Epp(
        rc, index, authenticator=Authenticator(config.auth), anonymous=is_anonymous(config.auth)
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        port, health_port = await epp.start(
            rc.epp_host, rc.epp_port, rc.epp_health_port, config.auth.tls
        )
        ready: dict[str, Any] = {
            "event": "ready",
            "grpc": f"{rc.epp_host}:{port}",
            "policy": rc.policy,
            "backends": len(epp.backends),
        }
        if health_port is not None:
            ready["health"] = f"{rc.epp_host}:{health_port}"
        print(json.dumps(ready), flush=True)
        await stop.wait()
        await epp.stop(grace=5.0)

    asyncio.run(main())
