"""The router's proxy over real sockets against stub instances: pass-through, retries before
the first byte (never after), ejection, 503/429, client disconnects, bad bodies, credentials."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvtier.core.auth import Authenticator
from kvtier.core.config.auth import AuthConfig
from kvtier.core.config.router import RouterConfig
from kvtier.core.http import HttpServer
from kvtier.index.api import ChunkIndex
from kvtier.router.proxy import Proxy
from kvtier.router.service import build

from support.stub_backend import STREAM_CHUNKS, StubBackend


@dataclass
class Rig:
    router: HttpServer
    url: str
    proxy: Proxy
    stubs: list[StubBackend]

    def post(self, path: str, body: dict, **kw: object) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=30, **kw)  # type: ignore[arg-type]

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start(
    stubs: list[StubBackend],
    auth: AuthConfig | None = None,
    index: ChunkIndex | None = None,
    **settings: object,
) -> Rig:
    config = RouterConfig(
        backends=[{"url": s.url, "name": s.name} for s in stubs],  # type: ignore[misc]
        policy=str(settings.pop("policy", "least-load")),
        **settings,  # type: ignore[arg-type]
    )
    authenticator = Authenticator(auth) if auth is not None else None
    app, proxy = build(config, index=index, probes=False, authenticator=authenticator)
    server = HttpServer(app, "127.0.0.1", 0)
    port = server.start()
    return Rig(server, f"http://127.0.0.1:{port}", proxy, stubs)


@pytest.fixture
def rig() -> Iterator[Rig]:
    stubs = [StubBackend("a"), StubBackend("b")]
    r = start(stubs, first_byte_timeout_s=2.0)
    try:
        yield r
    finally:
        r.router.stop()
        for s in stubs:
            s.stop()


BODY = {"model": "stub", "prompt": "hello there", "max_tokens": 3}


def test_non_streamed_request_is_forwarded_untouched(rig: Rig) -> None:
    resp = rig.post("/v1/completions", BODY)
    assert resp.status_code == 200
    served = [s for s in rig.stubs if s.state.received]
    assert len(served) == 1 and served[0].state.received == [BODY]  # no tokenizer: as sent
    assert resp.json()["served_by"] == served[0].name
    assert rig.metric("kvtier_router_realized_cached_tokens_total") == 4


def test_stream_is_relayed_byte_for_byte(rig: Rig) -> None:
    with httpx.stream("POST", f"{rig.url}/v1/completions", json={**BODY, "stream": True}) as r:
        got = b"".join(r.iter_raw())
    assert r.status_code == 200 and got == b"".join(STREAM_CHUNKS)
    assert rig.metric("kvtier_router_ttft_seconds_count") == 1


def test_503_before_the_first_byte_goes_elsewhere_and_ejects(rig: Rig) -> None:
    a = rig.stubs[0]
    a.state.mode = "503"
    for _ in range(4):
        assert rig.post("/v1/completions", BODY).json()["served_by"] == "b"
    assert len(a.state.received) == 1  # tried once, then ejected
    assert rig.metric('kvtier_router_retries_total{reason="http"}') == 1
    assert rig.metric("kvtier_router_ejections_total") == 1


def test_unreachable_instance_is_skipped(rig: Rig) -> None:
    rig.stubs[0].stop()
    for _ in range(3):
        assert rig.post("/v1/completions", BODY).json()["served_by"] == "b"


def test_hung_instance_times_out_and_the_request_goes_elsewhere(rig: Rig) -> None:
    a, _ = rig.stubs
    a.state.mode = "hang"
    start = time.monotonic()
    served = [rig.post("/v1/completions", BODY).json()["served_by"] for _ in range(2)]
    assert served == ["b", "b"]
    assert time.monotonic() - start < 60  # bounded by first_byte_timeout_s, not the hang


def test_every_instance_down_is_503_with_retry_after(rig: Rig) -> None:
    for s in rig.stubs:
        s.state.mode = "503"
    resp = rig.post("/v1/completions", BODY)
    assert resp.status_code == 503  # the last instance's own answer, after 2 retries
    resp = rig.post("/v1/completions", BODY)  # now both are ejected: the router answers
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert httpx.get(f"{rig.url}/readyz").status_code == 503


def test_saturated_is_429() -> None:
    stub = StubBackend("only")
    stub.state.mode = "slow-stream"
    r = start([stub], max_in_flight=1)
    try:
        with httpx.stream("POST", f"{r.url}/v1/completions", json={**BODY, "stream": True}) as s:
            chunks = s.iter_raw()  # (a dropped iterator would close the stream)
            next(chunks)  # one request in flight, holding the only slot
            resp = r.post("/v1/completions", BODY)
            assert resp.status_code == 429 and "Retry-After" in resp.headers
    finally:
        r.router.stop()
        stub.stop()


def test_a_stream_that_breaks_after_bytes_ends_with_an_error_event(rig: Rig) -> None:
    for s in rig.stubs:
        s.state.mode = "break"
    with httpx.stream("POST", f"{rig.url}/v1/completions", json={**BODY, "stream": True}) as r:
        got = b"".join(r.iter_raw())
    assert got.startswith(b"".join(STREAM_CHUNKS[:2]))
    last = got.rstrip().rsplit(b"\n\n", 1)[-1]
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == 502
    assert sum(len(s.state.received) for s in rig.stubs) == 1  # never retried after bytes


def test_client_going_away_cancels_the_upstream_request() -> None:
    stub = StubBackend("only")
    stub.state.mode = "slow-stream"
    r = start([stub])
    try:
        with httpx.stream("POST", f"{r.url}/v1/completions", json={**BODY, "stream": True}) as s:
            next(s.iter_raw())
        assert stub.state.cancelled.wait(20)  # the engine's generation was stopped
        deadline = time.monotonic() + 10
        while r.proxy.backends.all()[0].in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.proxy.backends.all()[0].in_flight == 0
    finally:
        r.router.stop()
        stub.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b'{"model": "stub"}'),
        ("/v1/chat/completions", b'{"model": "stub", "messages": []}'),
    ],
)
def test_bad_bodies_are_400_and_reach_no_instance(rig: Rig, path: str, body: bytes) -> None:
    resp = httpx.post(f"{rig.url}{path}", content=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert not any(s.state.received for s in rig.stubs)


def test_sessions_stick_with_the_sticky_policy() -> None:
    stubs = [StubBackend("a"), StubBackend("b"), StubBackend("c")]
    r = start(stubs, policy="sticky")
    try:
        seen = {
            session: {
                r.post("/v1/completions", BODY, headers={"x-session-id": session}).json()[
                    "served_by"
                ]
                for _ in range(3)
            }
            for session in ("s1", "s2", "s3")
        }
        assert all(len(v) == 1 for v in seen.values())
    finally:
        r.router.stop()
        for s in stubs:
            s.stop()


def test_credentials_guard_the_front_door() -> None:
    stub = StubBackend("only")
    auth = AuthConfig(
        credentials=[
            {"name": "app", "token": "client-token-0123456789", "role": "client"},  # type: ignore[list-item]
            {"name": "idx", "token": "reader-token-0123456789", "role": "reader"},  # type: ignore[list-item]
        ]
    )
    r = start([stub], auth=auth)
    try:
        assert r.post("/v1/completions", BODY).status_code == 401
        bearer = {"Authorization": "Bearer reader-token-0123456789"}
        assert r.post("/v1/completions", BODY, headers=bearer).status_code == 403
        bearer = {"Authorization": "Bearer client-token-0123456789"}
        assert r.post("/v1/completions", BODY, headers=bearer).status_code == 200
        assert "authorization" not in stub.state.headers[-1]  # the router's, not forwarded
    finally:
        r.router.stop()
        stub.stop()


def test_remote_tokenize_fallback_and_models(rig: Rig) -> None:
    resp = rig.post(
        "/v1/chat/completions", {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert resp.status_code == 200
    assert httpx.get(f"{rig.url}/v1/models").json()["data"][0]["id"] == "stub"


def test_the_chosen_instance_gets_the_routers_word_on_other_nodes() -> None:
    """An instance whose connector reads it (announced so) gets, in ``kv_transfer_params``,
    the best run of its prompt on another node as the index answered the decision; one
    without (plain vLLM, which warns on every request carrying such params) gets the body
    as sent (kvtier.core.engine_hint)."""
    from kvtier.core import engine_hint
    from kvtier.core.chunks import Tier
    from kvtier.core.keys import Namespace, prompt_keys
    from kvtier.index.api import ChunkOp, LocationKind, Registration
    from kvtier.index.backends.memory import MemoryIndex
    from kvtier.store.api.events import EventKind

    ns = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
    prompt = list(range(3, 3 + ns.chunk_tokens * 4 + 5))
    index = MemoryIndex()
    ns_id = index.register_namespace(ns)
    reader = {engine_hint.READER_ENDPOINT: engine_hint.READER}
    for name, node, endpoints in (("a", "n0", reader), ("b", "n1", {})):
        index.register(
            Registration(name, LocationKind.INSTANCE, (ns_id,), node=node, endpoints=endpoints)
        )
    for node in ("n0", "n1"):
        index.register(Registration(node, LocationKind.NODE, (ns_id,)))
    held = tuple(prompt_keys(ns, prompt)[:2])
    index.apply("n1", [ChunkOp(EventKind.STORED, Tier.CPU, ns_id, held)])
    stubs = [StubBackend("a"), StubBackend("b")]
    rig = start(stubs, index=index, policy="round-robin")
    try:
        body = {"model": "stub", "prompt": prompt, "max_tokens": 1}
        for _ in range(2):  # round-robin: one to each
            assert rig.post("/v1/completions", body).status_code == 200
        a, b = (s.state.received for s in stubs)
        word = {"kvtier": {"elsewhere_tokens": 2 * ns.chunk_tokens}}
        assert a == [{**body, "kv_transfer_params": word}]
        assert b == [body]
    finally:
        rig.router.stop()
        for s in stubs:
            s.stop()
