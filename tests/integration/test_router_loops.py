"""The router's background visits of its instances (``router/service.py``, ``Loops``): the
scrape of ``/metrics`` and the health probe, over real sockets against stub instances. Every
instance's load reaches the router, and an instance that never answers holds back no other's
scrape or probe (each is visited on its own schedule, the instances spread over the interval;
a round of all of them at once waited for the slowest, and a burst of pages to read delayed
every request that arrived during it: ``kvtier bench router-scrape``)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import httpx

from kvtier.core.config.router import RouterConfig
from kvtier.core.http import HttpServer
from kvtier.router.proxy import Proxy
from kvtier.router.service import build

from support.stub_backend import StubBackend


@contextlib.contextmanager
def router_over(stubs: list[StubBackend], **settings: float) -> Iterator[Proxy]:
    """A router with its background loops running, in front of ``stubs``; stops them all."""
    config = RouterConfig(
        backends=[{"url": s.url, "name": s.name} for s in stubs],  # type: ignore[misc]
        policy="least-load",
        **settings,  # type: ignore[arg-type]
    )
    app, proxy = build(config, index=None, probes=True)
    server = HttpServer(app, "127.0.0.1", 0)
    server.start()
    try:
        yield proxy
    finally:
        server.stop()
        for stub in stubs:
            stub.stop()


def wait_for(times: list[float], n: int) -> None:
    deadline = time.monotonic() + 30
    while len(times) < n and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_hung_page_does_not_hold_back_the_other_instances_scrapes() -> None:
    stubs = [StubBackend("hung"), StubBackend("b"), StubBackend("c")]
    hung, b, _ = stubs
    hung.state.metrics_hang = True
    with router_over(stubs, scrape_s=0.3) as proxy:
        # b's page says one request runs once one has reached it (the stub counts them)
        body = {"model": "stub", "prompt": "hello", "max_tokens": 1}
        assert httpx.post(f"{b.url}/v1/completions", json=body, timeout=10).status_code == 200
        wait_for(hung.state.metrics_gets, 3)
        assert len(hung.state.metrics_gets) >= 3, "the router stopped asking the hung instance"
        # between two asks of the hung instance (each waits out the scrape's 2 s deadline), b
        # was asked on its own schedule, more than once: not once per round of all of them
        first, second = hung.state.metrics_gets[1:3]
        asked = [t for t in b.state.metrics_gets if first < t < second]
        assert len(asked) >= 2, (len(asked), second - first)
        backend_b = next(x for x in proxy.backends.all() if x.url == b.url)
        assert backend_b.scraped_running == 1


def test_a_hung_probe_does_not_hold_back_the_other_instances_probes() -> None:
    stubs = [StubBackend("hung"), StubBackend("b")]
    hung, b = stubs
    hung.state.probe_hang = True
    with router_over(stubs, probe_s=0.3, probe_timeout_s=2.0, scrape_s=3600) as proxy:
        wait_for(hung.state.probe_times, 3)
        assert len(hung.state.probe_times) >= 3, "the router stopped probing the hung instance"
        first, second = hung.state.probe_times[1:3]
        probed = [t for t in b.state.probe_times if first < t < second]
        assert len(probed) >= 2, (len(probed), second - first)
        by_url = {x.url: x for x in proxy.backends.all()}
        assert by_url[hung.url].ejected_reason and not by_url[b.url].ejected_reason


def test_scrapes_stay_under_their_rate_cap_whatever_the_fleet() -> None:
    """``router.max_scrapes_per_s``: 3 instances to scrape every 0.05 s would be 60 scrapes a
    second; capped at 6, each instance is scraped about twice a second, not 20 times."""
    stubs = [StubBackend(name) for name in ("a", "b", "c")]
    with router_over(stubs, scrape_s=0.05, max_scrapes_per_s=6, probe_s=3600):
        gets = stubs[0].state.metrics_gets
        wait_for(gets, 4)
        assert len(gets) >= 4, "the router stopped scraping"
        # after the first round (all at once at start): one scrape per 3 / 6 s, not per 0.05 s
        spacing = [later - earlier for earlier, later in itertools.pairwise(gets[1:])]
        assert min(spacing) > 0.25, spacing
