"""The router under faults it must contain: a frozen index (SIGSTOP: connections accepted,
nothing answered) costs a request at most the index deadline, not the RPC timeout, and
/readyz says the index is degraded while the router keeps serving; a client that drops a
non-streamed request cancels it upstream. Real processes over real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvtier.core.http import HttpServer
from kvtier.testing.services import Service

from support.router_rig import metric, router_over_announced, router_url, start_router, wait_for
from support.stub_backend import StubBackend

PROMPT = list(range(1, 600))  # two full 256-token chunks: the router asks the index about them
BODY = {"model": "stub", "prompt": PROMPT, "max_tokens": 1}


@dataclass
class Fleet:
    index: Service
    stub: StubBackend
    router: Service

    @property
    def url(self) -> str:
        return router_url(self.router)


STALE_S = 0.5  # the router's replica of the index: how stale it may answer


@pytest.fixture(params=["replica", "queries"])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """An index, one instance announced to it with its namespace, a router discovering it
    (deciding from its replica of the index, or asking the index each decision)."""
    stub = StubBackend("inst")
    env = {
        "KVTIER_ROUTER__INDEX_REPLICA": str(request.param == "replica").lower(),
        "KVTIER_ROUTER__INDEX_REPLICA_MAX_STALE_S": str(STALE_S),
    }
    try:
        with router_over_announced(stub.url, env) as (index, router):
            yield Fleet(index, stub, router)
    finally:
        stub.stop()


def timed_post(url: str) -> tuple[int, float]:
    start = time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    return resp.status_code, time.monotonic() - start


def test_a_frozen_index_costs_requests_its_deadline_not_its_timeout(fleet: Fleet) -> None:
    url = fleet.url
    status, _ = timed_post(url)
    assert status == 200
    os.kill(fleet.index.proc.pid, signal.SIGSTOP)
    try:
        # a replica answers from its copy while it is fresh, then the decisions ask the index
        time.sleep(STALE_S + 0.2)
        for _ in range(6):  # more requests than the gate has slots for late calls
            status, seconds = timed_post(url)
            assert status == 200
            assert seconds < 2.0, f"a request took {seconds:.1f} s with the index frozen"
        ready = httpx.get(f"{url}/readyz", timeout=5)
        assert ready.status_code == 200  # still routing (by load): not an outage
        assert ready.json()["index"] == "degraded", ready.json()
        assert metric(url, "kvtier_router_index_degraded_total") >= 6
    finally:
        os.kill(fleet.index.proc.pid, signal.SIGCONT)

    def recovered() -> bool:
        timed_post(url)
        return bool(httpx.get(f"{url}/readyz").json()["index"] == "ok")

    wait_for(recovered, timeout=60, what="the index answers again")


@dataclass
class SlowState:
    arrived: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)


def slow_instance(state: SlowState) -> FastAPI:
    """An instance whose non-streamed completions take a minute, noticing a disconnect as
    vLLM does (it aborts the request when the connection closes)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> Response:
        body = await request.json()
        if body.get("prompt") == [1] and body.get("max_tokens") == 1:  # the router's probe
            return JSONResponse({"choices": [{"text": "x"}]})
        state.arrived.set()
        for _ in range(1200):
            if await request.is_disconnected():
                state.disconnected.set()
                return Response(status_code=499)
            await asyncio.sleep(0.05)
        return JSONResponse({"choices": [{"text": "finally"}]})

    @app.get("/v1/models")
    def models() -> dict:
        return {"data": [{"id": "stub"}]}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response("vllm:num_requests_running 0\n", media_type="text/plain")

    return app


def test_a_client_dropping_a_non_streamed_request_cancels_it_upstream() -> None:
    state = SlowState()
    server = HttpServer(slow_instance(state), "127.0.0.1", 0)
    port = server.start()
    router = start_router(["--backend", f"http://127.0.0.1:{port}"])
    try:
        host, router_port = router.ready["http"].rsplit(":", 1)
        body = json.dumps(BODY).encode()
        client = socket.create_connection((host, int(router_port)), timeout=10)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert state.arrived.wait(10), "the request never reached the instance"
        client.close()  # the client gives up before the (non-streamed) answer
        assert state.disconnected.wait(10), "the instance kept generating for nobody"
    finally:
        router.stop()
        server.stop()
