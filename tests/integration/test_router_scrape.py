"""The router's scrape of its instances' ``/metrics`` (``router/service.py``, ``Loops``), over
real sockets against stub instances: every instance's load reaches the router, and an instance
whose page never comes does not hold back the others' (each is asked on its own schedule, the
instances spread over ``router.scrape_s``; a burst of all of them at once delayed every request
that arrived during it: ``kvtier bench router-scrape``)."""

from __future__ import annotations

import time

import httpx

from kvtier.core.config.router import RouterConfig
from kvtier.core.http import HttpServer
from kvtier.router.service import build

from support.stub_backend import StubBackend


def test_a_hung_page_does_not_hold_back_the_other_instances_scrapes() -> None:
    stubs = [StubBackend("hung"), StubBackend("b"), StubBackend("c")]
    hung, b, _ = stubs
    hung.state.metrics_hang = True
    config = RouterConfig(
        backends=[{"url": s.url, "name": s.name} for s in stubs],  # type: ignore[misc]
        policy="least-load",
        scrape_s=0.3,
    )
    app, proxy = build(config, index=None, probes=True)
    server = HttpServer(app, "127.0.0.1", 0)
    server.start()
    try:
        # b's page says one request runs once one has reached it (the stub counts them)
        body = {"model": "stub", "prompt": "hello", "max_tokens": 1}
        assert httpx.post(f"{b.url}/v1/completions", json=body, timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while len(hung.state.metrics_gets) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(hung.state.metrics_gets) >= 3, "the router stopped asking the hung instance"
        # between two asks of the hung instance (each waits out the scrape's 2 s deadline), b
        # was asked on its own schedule, more than once: not once per round of all of them
        first, second = hung.state.metrics_gets[1:3]
        asked = [t for t in b.state.metrics_gets if first < t < second]
        assert len(asked) >= 2, (len(asked), second - first)
        backend_b = next(x for x in proxy.backends.all() if x.url == b.url)
        assert backend_b.scraped_running == 1
    finally:
        server.stop()
        for stub in stubs:
            stub.stop()
