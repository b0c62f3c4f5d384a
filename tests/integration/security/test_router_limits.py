"""Hostile bodies and connections at the router's door: malformed token ids are 400 (never a
500, never forwarded), an over-limit chunked body is 413, a half-sent request is closed after
the header timeout, connections beyond the cap are refused, and /healthz keeps answering
while a large prompt is parsed. Real processes over real sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, Request

from kvtier.core.config.router import RouterConfig
from kvtier.testing.services import Service

from support.router_rig import metric, router_over_announced, router_url, start_router
from support.stub_backend import StubBackend


@dataclass
class Door:
    router: Service
    stub: StubBackend

    @property
    def url(self) -> str:
        return router_url(self.router)

    def forwarded(self) -> int:
        return len(self.stub.state.received)


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    """A router with default limits in front of one instance announced with its namespace
    (so token ids become chunk keys: where a bad id used to fail with a 500)."""
    stub = StubBackend("inst", body_limit=64 << 20)  # takes whatever the router forwards
    try:
        with router_over_announced(stub.url) as (_, router):
            yield Door(router, stub)
    finally:
        stub.stop()


HOSTILE = {
    "negative id": b'{"prompt": [-1, 2]}',
    "id over uint32": b'{"prompt": [4294967296]}',
    "float id": b'{"prompt": [1.5, 2]}',
    "boolean id": b'{"prompt": [true, 2]}',
    "infinite id": b'{"prompt": [1e400]}',
    "NaN id": b'{"prompt": [NaN]}',
    "batch of string lists": b'{"prompt": [["a", "b"]]}',
    "mixed batch": b'{"prompt": ["a", 1]}',
    "batch with a bad id": b'{"prompt": [[1, -5]]}',
    "batch of lists and strings": b'{"prompt": [[1], "a"]}',
    "empty batch member": b'{"prompt": [[]]}',
    "empty prompt list": b'{"prompt": []}',
    "object prompt": b'{"prompt": {"a": 1}}',
    "user not a string": b'{"prompt": "hi", "user": {"a": 1}}',
    "stream not a boolean": b'{"prompt": "hi", "stream": "yes"}',
}


@pytest.mark.parametrize("body", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_prompts_are_400_and_reach_no_instance(door: Door, body: bytes) -> None:
    before = door.forwarded()
    resp = httpx.post(
        f"{door.url}/v1/completions",
        content=body.replace(b"{", b'{"model": "stub", "max_tokens": 1, ', 1),
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert any(word in error["message"] for word in ("prompt", "user", "stream")), error
    assert door.forwarded() == before


@pytest.mark.parametrize(
    "prompt", ["text", [1, 2, 3], ["a", "b"], [[1, 2], [3]], [0, 4294967295]], ids=str
)
def test_valid_prompt_shapes_still_pass(door: Door, prompt: object) -> None:
    body = {"model": "stub", "prompt": prompt, "max_tokens": 1}
    resp = httpx.post(f"{door.url}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200 and door.stub.state.received[-1]["prompt"] == prompt


def test_chunked_body_over_the_limit_is_413(door: Door) -> None:
    limit = RouterConfig().max_body_bytes

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        yield b'{"model": "stub", "prompt": "'
        for _ in range(limit // (64 << 10) + 2):
            yield b"x" * (64 << 10)
        yield b'"}'

    before = door.forwarded()
    resp = httpx.post(f"{door.url}/v1/completions", content=chunks(), timeout=30)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == 413
    assert door.forwarded() == before
    assert httpx.get(f"{door.url}/healthz", timeout=5).status_code == 200


def test_a_128k_token_prompt_fits_the_default_limit(door: Door) -> None:
    """The default body limit is sized for a 128k-token prompt, as ids or as text."""
    ids = [150_000 - i for i in range(131_072)]  # six-digit ids: the longest vocabularies
    text = " ".join(f"w{i % 997}" for i in range(131_072))  # ~1 token a word
    for prompt in (ids, text):
        body = {"model": "stub", "prompt": prompt, "max_tokens": 1}
        resp = httpx.post(f"{door.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200


def test_healthz_answers_while_large_prompts_are_parsed(door: Door) -> None:
    """A 59 MiB prompt (refused by size now; it stalled the event loop for seconds) and a few
    prompts at the limit (parsed off the event loop) while /healthz is polled."""
    limit = RouterConfig().max_body_bytes
    per_id = len(b"123456,")
    at_limit = (
        b'{"model": "stub", "max_tokens": 1, "prompt": ['
        + b"123456," * ((limit - 100) // per_id)
        + b"1]}"
    )
    huge = (
        b'{"model": "stub", "max_tokens": 1, "prompt": ['
        + b"123456," * ((59 << 20) // per_id)
        + b"1]}"
    )
    statuses: list[int] = []

    def post(body: bytes) -> None:
        resp = httpx.post(
            f"{door.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
        )
        statuses.append(resp.status_code)

    senders = [threading.Thread(target=post, args=(b,)) for b in (huge, at_limit, at_limit)]
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            start = time.monotonic()
            assert client.get(f"{door.url}/healthz").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
    for t in senders:
        t.join()
    assert worst < 1.0, f"/healthz took {worst:.2f} s while prompts were parsed"
    assert sorted(statuses) == [200, 200, 413]


def _half_sent(host: str, port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """What the server sends on a connection that sent ``data`` and stalls, and when it
    closed it (``wait_s`` if it did not)."""
    start = time.monotonic()
    conn = socket.create_connection((host, port), timeout=wait_s)
    got = b""
    try:
        conn.sendall(data)
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                return got, time.monotonic() - start
            got += chunk
    except TimeoutError:
        return got, wait_s
    finally:
        conn.close()


def test_router_closes_a_half_sent_request_after_its_header_timeout() -> None:
    stub = StubBackend("only")
    router = start_router(["--backend", stub.url], {"KVTIER_ROUTER__HEADER_TIMEOUT_S": "1"})
    try:
        host, port = router.ready["http"].rsplit(":", 1)
        for data in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"GE", b""):
            got, seconds = _half_sent(host, int(port), data, wait_s=15)
            assert seconds < 10, f"{data!r}: still open after {seconds:.0f} s"
            assert got.startswith(b"HTTP/1.1 408"), got
        resp = httpx.post(
            f"{router_url(router)}/v1/completions",
            json={"model": "stub", "prompt": [1, 2], "max_tokens": 1},
            timeout=10,
        )
        assert resp.status_code == 200  # whole requests are served as before
        assert metric(router_url(router), "kvtier_router_rejected_total") == 0
    finally:
        router.stop()
        stub.stop()


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def test_http_server_caps_connections_and_times_out_headers() -> None:
    """The shared HttpServer (store, index): past ``max_connections`` a new connection is
    answered 503 and closed at once; idle half-sent ones are closed after the timeout."""
    from kvtier.core.http import HttpServer

    server = HttpServer(_app(), "127.0.0.1", 0, header_timeout_s=1.5, max_connections=4)
    port = server.start()
    held: list[socket.socket] = []
    try:
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            held[-1].sendall(b"GET /heal")  # half a request line each
        time.sleep(0.2)
        got, seconds = _half_sent("127.0.0.1", port, b"", wait_s=10)
        assert got.startswith(b"HTTP/1.1 503") and seconds < 1.0, (got, seconds)
        for conn in held:  # the server closes each half-sent one after the header timeout
            conn.settimeout(10)
            assert conn.recv(4096).startswith(b"HTTP/1.1 408")
        time.sleep(0.2)
        resp = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert resp.status_code == 200  # slots free again
    finally:
        for conn in held:
            conn.close()
        server.stop()


def test_http_server_times_out_a_trickled_body() -> None:
    """Headers whole, then the body stalls: 408 once ``body_timeout_s`` has passed."""
    from kvtier.core.http import HttpServer

    app = _app()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    server = HttpServer(app, "127.0.0.1", 0, body_timeout_s=1.0)
    port = server.start()
    try:
        request = b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\nab"
        got, seconds = _half_sent("127.0.0.1", port, request, wait_s=15)
        assert got.startswith(b"HTTP/1.1 408") and seconds < 10, (got, seconds)
        whole = httpx.post(f"http://127.0.0.1:{port}/echo", content=b"x" * 100, timeout=5)
        assert whole.json() == {"bytes": 100}
    finally:
        server.stop()


def test_body_over_the_limit_by_content_length_is_413_before_it_is_read(
    door: Door,
) -> None:
    """Refused before a byte of the body is read; the router keeps serving."""
    limit = RouterConfig().max_body_bytes
    host, port = door.router.ready["http"].rsplit(":", 1)
    got, _ = _half_sent(
        host,
        int(port),
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {limit + 1}\r\n\r\n".encode(),
        wait_s=10,
    )
    assert got.startswith(b"HTTP/1.1 413"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413
