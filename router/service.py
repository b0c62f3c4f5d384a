"""``kvtier router serve``: the proxy, its background loops, and how they are put together.

Loops (on the proxy's event loop):
- refresh: re-read announced instances from the index every ``refresh_s``;
- scrape: each instance's ``/metrics`` every ``scrape_s`` (running, waiting, KV usage), the
  instances spread over the interval;
- probe: a real 1-token completion per instance every ``probe_s`` — a port that answers says
  nothing about a deadlocked engine. A failed probe ejects; a passing one re-admits. Spread
  over the interval as the scrape is, each instance on its own (a hung one, waited on for
  ``probe_timeout_s``, delays no other's probe).

Served by uvicorn with kvtier's HTTP limits (``kvtier.core.http.server_config``: header and body
deadlines, body size, connection cap) and ``auth.tls`` (TLS; client certificates with
``ca_file``), as the store's and the index's HTTP servers are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from kvtier.core.auth import Authenticator
from kvtier.core.config import KvtierConfig
from kvtier.core.config.router import RouterConfig
from kvtier.core.http import server_config
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import ChunkIndex
from kvtier.index.client.replica import IndexReplica
from kvtier.router.backends import Backend, Backends
from kvtier.router.core import RoutingCore
from kvtier.router.discovery import DiscoveryPolicy, is_anonymous
from kvtier.router.engine_load import engine_load
from kvtier.router.http import build_app
from kvtier.router.metrics import RouterMetrics
from kvtier.router.peers import PeerShares, replica_name
from kvtier.router.policies import Policy, TierCosts, make_policy
from kvtier.router.proxy import Proxy
from kvtier.router.responses import error_body
from kvtier.router.tokenize import PromptTokenizer
from kvtier.router.upstream import UpstreamClients

log = logging.getLogger(__name__)


def load_costs(config: RouterConfig) -> TierCosts:
    """kappa from ``router.kappa_file`` (``kvtier bench tier-latency --kappa-out``)."""
    return TierCosts.from_file(config.kappa_file)


def make_router_policy(config: RouterConfig) -> Policy:
    return make_policy(config.policy, config.dram_credit, load_costs(config))


class Loops:
    """The background loops of one router; ``run`` until cancelled."""

    def __init__(
        self,
        backends: Backends,
        config: RouterConfig,
        metrics: RouterMetrics,
        upstream: UpstreamClients,
    ) -> None:
        self.backends = backends
        self.config = config
        self.metrics = metrics
        self.upstream = upstream
        self._models: dict[str, str] = {}

    async def run(self) -> None:
        await asyncio.gather(self._refresh(), self._scrape(), self._probe())

    async def _refresh(self) -> None:
        while True:
            await asyncio.to_thread(self.backends.refresh)
            await self.upstream.close_unused({b.url for b in self.backends.all()})
            ejected = sum(1 for b in self.backends.all() if b.ejected_reason)
            self.metrics.backends.labels("known").set(len(self.backends))
            self.metrics.backends.labels("ejected").set(ejected)
            await asyncio.sleep(self.config.refresh_s)

    async def _scrape(self) -> None:
        await self._each(self.config.scrape_s, self.config.max_scrapes_per_s, self._scrape_one)

    async def _each(
        self,
        interval_s: float,
        max_per_s: float,
        visit: Callable[[Backend], Coroutine[Any, Any, object]],
    ) -> None:
        """``visit`` every instance every ``interval_s``: all at once at start, then one after
        another spread over the interval, each on its own. Not all at once every time: a
        burst of N pages to read delays every request that arrives during it (``kvtier bench
        router-scrape``). Each on its own: one instance slow to answer (up to its deadline)
        holds back no other's visit, and is not visited twice at once. At most ``max_per_s``
        visits a second: a fleet larger than ``interval_s * max_per_s`` is visited less often
        (at 1,000 instances a scrape a second each would take more than the router's core)."""
        await asyncio.gather(*(visit(b) for b in self.backends.all()))
        await asyncio.sleep(interval_s)
        in_flight: dict[str, asyncio.Task[object]] = {}
        try:
            while True:
                backends = self.backends.all()
                gap = max(interval_s / max(1, len(backends)), 1.0 / max_per_s)
                for backend in backends:
                    task = in_flight.get(backend.url)
                    if task is None or task.done():
                        in_flight[backend.url] = asyncio.create_task(visit(backend))
                    await asyncio.sleep(gap)
                if not backends:
                    await asyncio.sleep(interval_s)
                known = {b.url for b in backends}
                for url in [u for u in in_flight if u not in known and in_flight[u].done()]:
                    del in_flight[url]
        finally:  # stopped: no visit outlives the loop (nor the clients closed after it)
            for task in in_flight.values():
                task.cancel()
            await asyncio.gather(*in_flight.values(), return_exceptions=True)

    async def _scrape_one(self, backend: Backend) -> None:
        try:
            client = self.upstream.to(backend.url)
            resp = await client.get(f"{backend.url}/metrics", timeout=2.0)
            resp.raise_for_status()
            load = engine_load(resp.text)  # microseconds: fine on the event loop
            self.backends.scraped(backend, load.running, load.waiting, load.kv_usage)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("router: scraping %s failed: %s", backend.name, exc)

    async def _probe(self) -> None:
        await self._each(self.config.probe_s, self.config.max_probes_per_s, self.probe)

    async def probe(self, backend: Backend) -> bool:
        """A real completion of one token; ejects on failure, re-admits on success."""
        timeout = self.config.probe_timeout_s
        client = self.upstream.to(backend.url)
        try:
            model = self._models.get(backend.url)
            if model is None:
                resp = await client.get(f"{backend.url}/v1/models", timeout=timeout)
                model = self._models[backend.url] = resp.json()["data"][0]["id"]
            resp = await client.post(
                f"{backend.url}/v1/completions",
                json={"model": model, "prompt": [1], "max_tokens": 1},
                timeout=timeout,
            )
            resp.raise_for_status()
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            if self.backends.eject(backend, f"probe failed: {exc!r}"):
                self.metrics.ejections.labels("probe").inc()
            return False
        if backend.ejected_reason:
            log.info("router: %s passes its probe again", backend.name)
            self.backends.admit(backend)
        return True


def make_core(
    config: RouterConfig, index: ChunkIndex | None, metrics: RouterMetrics, anonymous: bool
) -> RoutingCore:
    """Instances (as ``router.discover_allow`` admits them), the policy and the index with
    its deadline: what the proxy and the endpoint picker share."""
    discovery = DiscoveryPolicy.from_config(config, anonymous, metrics.discovery_refused.inc)
    if index is not None:
        discovery.warn_if_closed(config)
    backends = Backends(config, index, discovery)
    backends.refresh()
    core = RoutingCore(
        backends,
        make_router_policy(config),
        index,
        config.speculative_s,
        config.decision_log,
        index_timeout_s=config.index_timeout_s,
        on_index_degraded=lambda reason: metrics.index_degraded.labels(reason).inc(),
    )
    if isinstance(index, IndexReplica) and config.share_state:
        core.peers = PeerShares(
            replica_name(config.name),
            backends,
            index,
            core.speculative.record,
            config.share_interval_s,
            config.share_ttl_s,
        )
    return core


def build(
    config: RouterConfig,
    index: ChunkIndex | None,
    probes: bool = True,
    authenticator: Authenticator | None = None,
    anonymous: bool | None = None,
) -> tuple[FastAPI, Proxy]:
    """The router's app and proxy (``probes`` False: no background loops, for tests;
    ``authenticator``: who may send requests, when credentials are configured;
    ``anonymous``: no credentials anywhere, so announced loopback instances are admitted
    without ``router.discover_allow`` — by default, when ``authenticator`` checks nothing)."""
    if anonymous is None:
        anonymous = authenticator is None or not authenticator.enabled
    metrics = RouterMetrics()
    core = make_core(config, index, metrics, anonymous)
    if isinstance(index, IndexReplica):
        replica = index
        metrics.replica_lag.set_function(lambda: replica.lag_s() or -1.0)
    if core.peers is not None:
        peers = core.peers
        metrics.peers.set_function(lambda: len(peers.peers()))
    backends = core.backends
    tokenizer = PromptTokenizer(config.model) if config.model else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(
        connect=config.connect_timeout_s, read=config.first_byte_timeout_s, write=60, pool=None
    )
    upstream = UpstreamClients(limits, timeout)
    proxy = Proxy(core, config, metrics, upstream, tokenizer, authenticator)
    loops = Loops(backends, config, metrics, upstream)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(loops.run()) if probes else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await upstream.aclose()
            core.close()

    app = build_app(proxy)
    app.router.lifespan_context = lifespan
    return app, proxy


def serve(config: KvtierConfig) -> None:
    """Run the router until SIGINT/SIGTERM (uvicorn's handlers). Prints a JSON ready line."""
    from kvtier.core.auth import check_exposure

    rc = config.router
    # The front door spends GPU time: off loopback it needs credentials (role client).
    check_exposure("kvtier router", [rc.host], config.auth)
    auth = ClientAuth.from_config(config.auth)
    index = router_index(config, auth)
    app, _ = build(
        rc, index, authenticator=Authenticator(config.auth), anonymous=is_anonymous(config.auth)
    )
    tls = config.auth.tls
    server = uvicorn.Server(
        server_config(
            app,
            rc.host,
            rc.port,
            tls,
            rc.max_body_bytes,  # refused before it is read
            header_timeout_s=rc.header_timeout_s,
            body_timeout_s=rc.body_timeout_s,
            max_connections=rc.max_connections,
            error_body=error_body,
        )
    )

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            ready: dict[str, Any] = {
                "event": "ready",
                "http": f"{rc.host}:{port}",
                "tls": tls.cert_file is not None,
                "policy": rc.policy,
            }
            print(json.dumps(ready), flush=True)
        await task

    asyncio.run(main())


def router_index(config: KvtierConfig, auth: ClientAuth) -> ChunkIndex | None:
    """The index a router reads (``index.address``): its replica (``router.index_replica``)
    or its client; None when no index is configured."""
    from kvtier.index.client import connect

    if not config.index.address:
        return None
    index = connect(config.index, auth)
    if not config.router.index_replica:
        return index
    return IndexReplica(index, config.router.index_replica_max_stale_s)
