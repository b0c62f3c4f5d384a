"""The Gateway API endpoint picker (``kvtier router epp``) over a real gRPC socket, against a
client playing Envoy's side of the ext_proc protocol as the Inference Extension's proposal
004-endpoint-picker-protocol specifies (no Envoy binary is installable here): the pick as a
header and ``envoy.lb`` metadata, subset hints, 503/429/400 immediate responses, gRPC health,
sticky sessions, FULL_DUPLEX_STREAMED and BUFFERED bodies, credentials. The instances are stub
HTTP servers: the EPP only picks (and asks one for ``/tokenize``, having no tokenizer).
Last, the command (``kvtier router epp`` as a process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.core.auth import Authenticator
from kvtier.core.config.auth import AuthConfig
from kvtier.core.config.router import RouterConfig
from kvtier.router.epp import endpoint_of
from kvtier.router.epp_service import Epp, EppServer

from support.ext_proc import (
    BODY,
    Envoy,
    destination,
    http_headers,
    metadata,
    set_headers,
    subset_hint,
)
from support.stub_backend import StubBackend

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
MODE = processing_mode_pb2.ProcessingMode


@dataclass
class Rig:
    server: EppServer
    epp: Epp
    channel: grpc.Channel
    stubs: list[StubBackend]

    @property
    def endpoints(self) -> dict[str, str]:
        """ip:port -> stub name."""
        return {endpoint_of(s.url): s.name for s in self.stubs}

    def open(self) -> Envoy:
        return Envoy(self.channel)

    def pick(
        self,
        body: bytes | dict[str, Any] = BODY,
        path: str = "/v1/completions",
        meta: Any = None,
        keep: bool = False,
        headers: dict[str, str] | None = None,
    ) -> tuple[Any, Envoy]:
        """FULL_DUPLEX_STREAMED, as the extension's gateways send it: headers and the whole
        body without waiting; returns the first answer (the pick, or an immediate response)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        envoy = self.open()
        extra = {"metadata_context": meta} if meta is not None else {}
        envoy.send(request_headers=http_headers(path, extra=headers), **extra)
        envoy.send(request_body=pb.HttpBody(body=raw, end_of_stream=True), **extra)
        first = envoy.recv()
        if first.WhichOneof("response") == "request_headers":
            body_answer = envoy.recv()
            streamed = body_answer.request_body.response.body_mutation.streamed_response
            assert streamed.body == raw and streamed.end_of_stream  # the body, back unchanged
        if not keep:
            envoy.close()
        return first, envoy

    def chosen(self, **kw: Any) -> str:
        first, _ = self.pick(**kw)
        header, meta = destination(first)
        assert header == meta
        return self.endpoints[header]

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

    def wait_health(self, service: str, status: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.health(service) != status:
            assert time.monotonic() < deadline, f"health of {service!r} never became {status}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.channel.close()
        self.server.stop()
        for s in self.stubs:
            s.stop()


def start(n: int = 2, auth: AuthConfig | None = None, **settings: Any) -> Rig:
    stubs = [StubBackend(name) for name in "abcdefgh"[:n]]
    config = RouterConfig(
        backends=[{"url": s.url, "name": s.name} for s in stubs],
        policy=str(settings.pop("policy", "least-load")),
        **settings,
    )
    authenticator = Authenticator(auth) if auth is not None else None
    epp = Epp(config, index=None, probes=False, authenticator=authenticator)
    server = EppServer(epp)
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Rig(server, epp, channel, stubs)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = start(2)
    try:
        yield r
    finally:
        r.stop()


def in_flight(rig: Rig) -> dict[str, int]:
    return {b.name: b.in_flight for b in rig.epp.backends.all()}


def wait_idle(rig: Rig, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(in_flight(rig).values()):
        assert time.monotonic() < deadline, in_flight(rig)
        time.sleep(0.02)


# -- the pick ----------------------------------------------------------------------------------


def test_full_duplex_pick_sets_header_and_envoy_lb_metadata(rig: Rig) -> None:
    raw = json.dumps(BODY).encode()
    envoy = rig.open()
    envoy.send(request_headers=http_headers())
    envoy.send(request_body=pb.HttpBody(body=raw[:10], end_of_stream=False))  # two chunks
    envoy.send(request_body=pb.HttpBody(body=raw[10:], end_of_stream=True))
    head = envoy.recv()
    assert head.WhichOneof("response") == "request_headers"  # nothing before the whole body
    header, meta = destination(head)
    assert header == meta and header in rig.endpoints
    assert set_headers(head)["content-length"] == str(len(raw))
    body = envoy.recv().request_body.response.body_mutation.streamed_response
    assert body.body == raw and body.end_of_stream
    assert in_flight(rig)[rig.endpoints[header]] == 1  # dispatched there

    # the response passes through us too (FULL_DUPLEX_STREAMED both ways)
    envoy.send(response_headers=http_headers(method="GET", extra={":status": "200"}))
    assert envoy.recv().WhichOneof("response") == "response_headers"
    envoy.send(response_body=pb.HttpBody(body=b'{"choices": []}', end_of_stream=True))
    echoed = envoy.recv().response_body.response.body_mutation.streamed_response
    assert echoed.body == b'{"choices": []}' and echoed.end_of_stream
    assert envoy.close() == []
    wait_idle(rig)
    assert not any(s.state.received for s in rig.stubs)  # picked, never proxied


def test_buffered_mode_answers_headers_then_picks_on_the_body(rig: Rig) -> None:
    config = pb.ProtocolConfiguration(request_body_mode=MODE.BUFFERED, response_body_mode=MODE.NONE)
    envoy = rig.open()
    envoy.send(request_headers=http_headers("/v1/chat/completions"), protocol_config=config)
    continued = envoy.recv()  # Envoy waits for this before it sends the body
    assert continued.WhichOneof("response") == "request_headers"
    assert not continued.request_headers.response.header_mutation.set_headers
    envoy.send(request_body=pb.HttpBody(body=json.dumps(CHAT).encode(), end_of_stream=True))
    picked = envoy.recv()
    assert picked.WhichOneof("response") == "request_body"
    header, meta = destination(picked)
    assert header == meta and header in rig.endpoints
    assert not picked.request_body.response.HasField("body_mutation")  # forwarded as sent
    assert envoy.close() == []
    wait_idle(rig)  # the stream's end is the request's end


def test_a_request_without_body_is_picked_on_its_headers(rig: Rig) -> None:
    envoy = rig.open()
    envoy.send(request_headers=http_headers("/v1/models", method="GET", eos=True))
    header, meta = destination(envoy.recv())
    assert header == meta and header in rig.endpoints
    envoy.close()


def test_subset_hint_restricts_the_choice() -> None:
    r = start(3)
    try:
        only = endpoint_of(r.stubs[1].url)
        held = []
        for _ in range(4):  # least-load would spread these; the hint keeps them on "b"
            first, envoy = r.pick(meta=subset_hint([only]), keep=True)
            assert destination(first)[0] == only
            held.append(envoy)
        pair = [endpoint_of(r.stubs[0].url), endpoint_of(r.stubs[2].url)]
        assert r.chosen(meta=subset_hint(",".join(pair))) in {"a", "c"}  # string form too
        for envoy in held:
            envoy.close()
        for hint in (["10.9.9.9:8000"], []):  # none of them eligible, or empty: 503
            first, _ = r.pick(meta=subset_hint(hint))
            assert first.immediate_response.status.code == 503
    finally:
        r.stop()


def test_fallbacks_and_the_served_endpoint() -> None:
    r = start(2, epp_fallbacks=1)
    try:
        first, envoy = r.pick(keep=True)
        header, meta = destination(first)
        primary, fallback = header.split(",")
        assert header == meta and {primary, fallback} == set(r.endpoints)
        assert in_flight(r)[r.endpoints[primary]] == 1
        # the gateway's retry went to the fallback: it says which endpoint served
        served = metadata("envoy.lb", {"x-gateway-destination-endpoint-served": fallback})
        envoy.send(
            response_headers=http_headers(method="GET", extra={":status": "200"}),
            metadata_context=served,
        )
        envoy.recv()
        assert in_flight(r) == {r.endpoints[primary]: 0, r.endpoints[fallback]: 1}
        envoy.close()
        wait_idle(r)
    finally:
        r.stop()


def test_a_5xx_answer_ejects_the_instance_that_gave_it(rig: Rig) -> None:
    first, envoy = rig.pick(keep=True)
    name = rig.endpoints[destination(first)[0]]
    envoy.send(response_headers=http_headers(method="GET", extra={":status": "503"}))
    assert envoy.recv().WhichOneof("response") == "response_headers"
    envoy.close()
    ejected = {b.name for b in rig.epp.backends.all() if b.ejected_reason}
    assert ejected == {name}
    assert {rig.chosen() for _ in range(3)} == {"a", "b"} - {name}


# -- nothing to pick, bad requests -------------------------------------------------------------


def test_every_instance_ejected_is_503_and_health_not_serving(rig: Rig) -> None:
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert rig.health(service) == health_pb2.HealthCheckResponse.SERVING
    for backend in rig.epp.backends.all():
        rig.epp.backends.eject(backend, "test")
    first, _ = rig.pick()
    reply = first.immediate_response
    assert reply.status.code == 503
    assert json.loads(reply.body)["error"]["type"] == "service_unavailable"
    assert any(h.header.key == "retry-after" for h in reply.headers.set_headers)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        rig.wait_health(service, not_serving)
    assert rig.health("liveness") == health_pb2.HealthCheckResponse.SERVING  # alive, not ready
    for backend in rig.epp.backends.all():
        rig.epp.backends.admit(backend)
    rig.wait_health("", health_pb2.HealthCheckResponse.SERVING)
    assert rig.chosen() in {"a", "b"}


def test_max_in_flight_reached_is_429() -> None:
    r = start(2, max_in_flight=1)
    try:
        held = [r.pick(keep=True)[1] for _ in range(2)]  # one request on each instance
        assert in_flight(r) == {"a": 1, "b": 1}
        first, _ = r.pick()
        assert first.immediate_response.status.code == 429
        assert json.loads(first.immediate_response.body)["error"]["type"] == "rate_limit_exceeded"
        assert r.health() == health_pb2.HealthCheckResponse.SERVING  # busy is not unhealthy
        held[0].close()  # that request ended: its slot is free again
        wait_until = time.monotonic() + 10
        while sum(in_flight(r).values()) != 1:
            assert time.monotonic() < wait_until
            time.sleep(0.02)
        assert r.chosen() in {"a", "b"}
        held[1].close()
    finally:
        r.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b'{"model": "stub"}'),
        ("/v1/chat/completions", b'{"model": "stub", "messages": []}'),
    ],
)
def test_bad_bodies_are_400(rig: Rig, path: str, body: bytes) -> None:
    first, _ = rig.pick(body, path=path)
    reply = first.immediate_response
    assert reply.status.code == 400
    assert json.loads(reply.body)["error"]["type"] == "invalid_request_error"
    assert not any(in_flight(rig).values())


def test_body_over_the_limit_is_413() -> None:
    r = start(1, max_body_bytes=64)
    try:
        first, _ = r.pick({**BODY, "prompt": "x" * 100})
        assert first.immediate_response.status.code == 413
    finally:
        r.stop()


# -- sessions, credentials ---------------------------------------------------------------------


def test_sticky_policy_keeps_a_session_on_one_endpoint_across_streams() -> None:
    r = start(3, policy="sticky")
    try:
        homes, held = {}, []
        for session in ("s1", "s2", "s3"):  # each first turn goes to the least loaded
            first, envoy = r.pick(keep=True, headers={"x-session-id": session})
            homes[session] = r.endpoints[destination(first)[0]]
            held.append(envoy)
        assert sorted(homes.values()) == ["a", "b", "c"]
        for _ in range(3):  # later turns, each its own stream, go home (equal load)
            for session, home in homes.items():
                assert r.chosen(headers={"x-session-id": session}) == home
        for envoy in held:
            envoy.close()
        wait_idle(r)
        # the session may also come from the body's "user", as in the proxy
        chat: dict[str, Any] = {"body": {**CHAT, "user": "u7"}, "path": "/v1/chat/completions"}
        first, envoy = r.pick(keep=True, **chat)
        home = r.endpoints[destination(first)[0]]
        _, other = r.pick(CHAT, "/v1/chat/completions", keep=True)  # no session: elsewhere
        # least-load would now pick the idle third instance; the session goes home
        assert r.chosen(**chat) == home
        envoy.close()
        other.close()
    finally:
        r.stop()


def test_credentials_are_checked_on_the_request_and_not_forwarded() -> None:
    auth = AuthConfig(
        credentials=[
            {"name": "app", "token": "client-token-0123456789", "role": "client"},
            {"name": "idx", "token": "reader-token-0123456789", "role": "reader"},
        ]
    )
    r = start(1, auth=auth)
    try:
        first, _ = r.pick()
        assert first.immediate_response.status.code == 401
        first, _ = r.pick(headers={"authorization": "Bearer reader-token-0123456789"})
        assert first.immediate_response.status.code == 403
        first, _ = r.pick(headers={"authorization": "Bearer client-token-0123456789"})
        assert destination(first)[0] == endpoint_of(r.stubs[0].url)
        assert list(first.request_headers.response.header_mutation.remove_headers) == [
            "authorization"
        ]
    finally:
        r.stop()


# -- the command -------------------------------------------------------------------------------


def test_kvtier_router_epp_serves_and_refuses_exposure_without_credentials() -> None:
    stub = StubBackend("a")
    env = dict(os.environ, KVTIER_LOG_LEVEL="warning")
    base = [sys.executable, "-m", "kvtier", "router", "epp", "--backend", stub.url]
    try:
        refused = subprocess.run(
            [*base, "--host", "0.0.0.0", "--port", "0"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert refused.returncode != 0 and "protected mode" in refused.stderr
        proc = subprocess.Popen(
            [*base, "--port", "0", "--health-port", "0"], stdout=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            assert ready["event"] == "ready" and ready["backends"] == 1
            for address in (ready["grpc"], ready["health"]):
                with grpc.insecure_channel(address) as channel:
                    check = health_pb2_grpc.HealthStub(channel).Check
                    status = check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
                    assert status.status == health_pb2.HealthCheckResponse.SERVING
            with grpc.insecure_channel(ready["grpc"]) as channel:
                envoy = Envoy(channel)
                envoy.send(request_headers=http_headers())
                envoy.send(
                    request_body=pb.HttpBody(body=json.dumps(BODY).encode(), end_of_stream=True)
                )
                assert destination(envoy.recv())[0] == endpoint_of(stub.url)
                envoy.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        stub.stop()
