"""mTLS on HTTP: a caller presenting no bearer token but a client certificate the handshake
verified is the credential whose ``tls_identity`` names the certificate's common name or a DNS
or URI subject alternative name, exactly as on gRPC (test_credentials.py has that side). The
store's, the index's and the router's HTTP servers as real processes, the endpoint picker's
gateway stream, and each uvicorn protocol class in process (one connection, one identity)."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvtier.core.auth import Authenticator, Permission, Principal
from kvtier.core.config.auth import AuthConfig, TlsConfig
from kvtier.core.http import HttpGuard, HttpServer
from kvtier.router.epp import endpoint_of
from kvtier.testing.services import Service, start_store

from support.certs import Authority
from support.ext_proc import BODY, Envoy, destination, http_headers
from support.router_rig import CLIENT_TOKEN, router_credentials, start_index, start_router
from support.secure_env import TOKENS, auth_env, credentials
from support.stub_backend import StubBackend

UNKNOWN_TOKEN = "unknown-token-0123456789"


def tls_env(
    ca: Authority, extra: list[dict[str, Any]], base: list[dict[str, Any]] | None = None
) -> dict[str, str]:
    """A service with the token credentials ``base`` (every role of secure_env by default),
    ``extra`` credentials, and mTLS (its certificate for 127.0.0.1, clients' signed by ``ca``)."""
    cert, key = ca.server()
    tokens = credentials() if base is None else base
    return {
        **auth_env(),
        "KVTIER_AUTH__CREDENTIALS": json.dumps([*tokens, *extra]),
        "KVTIER_AUTH__TLS__CERT_FILE": str(cert),
        "KVTIER_AUTH__TLS__KEY_FILE": str(key),
        "KVTIER_AUTH__TLS__CA_FILE": str(ca.cert_file),
    }


class Certified:
    """HTTPS clients of one service, each presenting a certificate ``ca`` issues."""

    def __init__(self, ca: Authority, hostport: str) -> None:
        self.ca = ca
        self.base = f"https://{hostport}"
        self._clients: list[httpx.Client] = []

    def client(
        self, name: str, common_name: str, dns: tuple[str, ...] = (), uris: tuple[str, ...] = ()
    ) -> httpx.Client:
        cert, key = self.ca.issue(name, common_name, dns=dns, uris=uris)
        context = ssl.create_default_context(cafile=str(self.ca.cert_file))
        context.load_cert_chain(str(cert), str(key))
        client = httpx.Client(verify=context, timeout=10, base_url=self.base)
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextmanager
def serving(service: Service, ca: Authority) -> Iterator[Certified]:
    certified = Certified(ca, service.ready["http"])
    try:
        yield certified
    finally:
        certified.close()
        service.stop()


def test_store_http_maps_a_certificate_to_its_credential(tmp_path: Path) -> None:
    """Store ``/stats`` (the index role's): a certificate naming an index credential reads it,
    one naming an engine is 403, one naming nobody (or two credentials) is 401; a bearer
    token, when presented, decides whatever the certificate."""
    ca = Authority(tmp_path)
    env = tls_env(
        ca,
        [
            {"name": "index-1", "role": "index", "tls_identity": "spiffe://kvtier/index-1"},
            {"name": "engine-1", "role": "engine", "tls_identity": "engine-1.kvtier"},
        ],
    )
    store = start_store(tmp_path / "run", "16MiB", "http-cert", remote=False, env=env)
    with serving(store, ca) as certified:
        indexer = certified.client("index-1", "some host", uris=("spiffe://kvtier/index-1",))
        stats = indexer.get("/stats")
        assert stats.status_code == 200, stats.text
        assert indexer.get("/stats").status_code == 200  # the same connection, again

        engine = certified.client("engine-1", "engine-1.kvtier")  # by common name
        refused = engine.get("/stats")
        assert refused.status_code == 403 and "engine-1" in refused.json()["detail"]

        stranger = certified.client("stranger", "stranger", uris=("spiffe://kvtier/stranger",))
        refused = stranger.get("/stats")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        # CN names one credential, a SAN another: which is meant is unknown, so neither
        both = certified.client("both", "engine-1.kvtier", uris=("spiffe://kvtier/index-1",))
        refused = both.get("/stats")
        assert refused.status_code == 401 and "several" in refused.json()["detail"]

        # a token decides: the stranger with the index's token reads; the index's
        # certificate with an engine's token is that engine, with an unknown one nobody
        assert stranger.get("/stats", headers=bearer(TOKENS["index"])).status_code == 200
        assert indexer.get("/stats", headers=bearer(TOKENS["engine-all"])).status_code == 403
        assert indexer.get("/stats", headers=bearer(UNKNOWN_TOKEN)).status_code == 401
        assert indexer.get("/healthz").status_code == 200


def test_index_http_maps_a_certificate_to_its_credential(tmp_path: Path) -> None:
    """Index ``/stats`` and ``/namespaces``: a reader certificate (DNS SAN) reads both; an
    index-role certificate may not query (403), an engine's may not list namespaces (403); an
    unnamed one is 401."""
    ca = Authority(tmp_path)
    env = tls_env(
        ca,
        [
            {"name": "router-1", "role": "reader", "tls_identity": "router-1.kvtier"},
            {"name": "indexer", "role": "index", "tls_identity": "indexer.kvtier"},
            {"name": "engine-1", "role": "engine", "tls_identity": "engine-1.kvtier"},
        ],
    )
    with serving(start_index(env), ca) as certified:
        reader = certified.client("router-1", "some host", dns=("router-1.kvtier",))
        for path in ("/stats", "/namespaces", "/locations"):
            resp = reader.get(path)
            assert resp.status_code == 200, (path, resp.text)
        assert certified.client("indexer", "indexer.kvtier").get("/stats").status_code == 403
        engine = certified.client("engine-1", "engine-1.kvtier")
        assert engine.get("/stats").status_code == 200  # an engine queries, ...
        assert engine.get("/namespaces").status_code == 403  # ... never lists every tenant's
        assert certified.client("nobody", "nobody.kvtier").get("/stats").status_code == 401
        assert reader.get("/namespaces", headers=bearer(TOKENS["engine-a"])).status_code == 403


def test_router_admits_a_certificate_named_by_a_client_credential(tmp_path: Path) -> None:
    """The router's front door: a certificate a ``client`` credential names sends a completion
    through without a token; a reader's certificate may not route (403), an unnamed one is
    401 unless it carries the client token."""
    ca = Authority(tmp_path)
    stub = StubBackend("behind-mtls")
    env = {
        **tls_env(
            ca,
            [
                {"name": "app-cert", "role": "client", "tls_identity": "spiffe://kvtier/app"},
                {"name": "router-1", "role": "reader", "tls_identity": "router-1.kvtier"},
            ],
            base=json.loads(router_credentials()),
        ),
        "KVTIER_ROUTER__POLICY": "round-robin",
    }
    try:
        with serving(start_router(["--backend", stub.url], env), ca) as certified:
            app = certified.client("app", "app host", uris=("spiffe://kvtier/app",))
            resp = app.post("/v1/completions", json=BODY)
            assert resp.status_code == 200 and resp.json()["served_by"] == "behind-mtls"
            assert "authorization" not in stub.state.headers[-1]

            reader = certified.client("router-1", "router-1.kvtier")
            refused = reader.post("/v1/completions", json=BODY)
            assert refused.status_code == 403, refused.text
            stranger = certified.client("stranger", "stranger.kvtier")
            assert stranger.post("/v1/completions", json=BODY).status_code == 401
            with_token = stranger.post("/v1/completions", json=BODY, headers=bearer(CLIENT_TOKEN))
            assert with_token.status_code == 200
            assert len(stub.state.received) == 2  # nothing refused reached the instance
    finally:
        stub.stop()


def test_endpoint_picker_maps_the_gateways_certificate(tmp_path: Path) -> None:
    """The EPP's caller is the gateway (its ext_proc stream's TLS peer): a request it forwards
    without a token is judged by the gateway's certificate, as a gRPC call would be."""
    ca = Authority(tmp_path)
    stub = StubBackend("a")
    env = tls_env(
        ca,
        [
            {"name": "gateway", "role": "client", "tls_identity": "spiffe://kvtier/gateway"},
            {"name": "router-1", "role": "reader", "tls_identity": "router-1.kvtier"},
        ],
        base=json.loads(router_credentials()),
    )
    argv = [sys.executable, "-m", "kvtier", "router", "epp", "--backend", stub.url, "--port", "0"]
    env = {**os.environ, "KVTIER_LOG_LEVEL": "warning", **env}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)

    def pick(common_name: str, uris: tuple[str, ...] = (), token: str | None = None) -> Any:
        cert, key = ca.issue(common_name, common_name, uris=uris)
        creds = grpc.ssl_channel_credentials(
            ca.cert_file.read_bytes(), key.read_bytes(), cert.read_bytes()
        )
        with grpc.secure_channel(ready["grpc"], creds) as channel:
            envoy = Envoy(channel)
            extra = {"authorization": f"Bearer {token}"} if token else None
            envoy.send(request_headers=http_headers(extra=extra))
            envoy.send(request_body=pb.HttpBody(body=json.dumps(BODY).encode(), end_of_stream=True))
            first = envoy.recv()
            envoy.close()
            return first

    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        picked = pick("gateway host", uris=("spiffe://kvtier/gateway",))
        assert destination(picked)[0] == endpoint_of(stub.url)
        assert pick("router-1.kvtier").immediate_response.status.code == 403
        assert pick("stranger.kvtier").immediate_response.status.code == 401
        assert destination(pick("stranger.kvtier", token=CLIENT_TOKEN))[0] == endpoint_of(stub.url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stub.stop()


@pytest.mark.parametrize("protocol", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_each_connection_is_judged_by_its_own_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: type
) -> None:
    """Both uvicorn protocol classes: the identity belongs to the connection, kept across its
    requests (keep-alive), never seen by another connection's requests interleaved with them."""
    monkeypatch.setattr("kvtier.core.http.AutoHTTPProtocol", protocol)
    ca = Authority(tmp_path)
    cert, key = ca.server()
    tls = TlsConfig(cert_file=cert, key_file=key, ca_file=ca.cert_file)
    auth = AuthConfig(
        credentials=[
            {"name": "r", "role": "reader", "tls_identity": "reader.kvtier"},
            {"name": "e", "role": "engine", "tls_identity": "spiffe://kvtier/engine"},
            {"name": "t", "role": "engine", "token": TOKENS["engine-all"]},
        ],
        tls=tls,
    )
    guard = HttpGuard(Authenticator(auth))
    app = FastAPI()
    querier = guard.require(Permission.INDEX_QUERY)  # the caller, a Principal

    @app.get("/who")
    def who(principal: Principal = querier) -> str:
        return principal.name

    server = HttpServer(app, "127.0.0.1", 0, tls)
    port = server.start()
    certified = Certified(ca, f"127.0.0.1:{port}")
    try:
        reader = certified.client("reader", "reader.kvtier")
        engine = certified.client("engine", "engine host", uris=("spiffe://kvtier/engine",))
        stranger = certified.client("stranger", "stranger.kvtier")
        for _ in range(3):
            assert reader.get("/who").json() == "r"
            assert engine.get("/who").json() == "e"
            assert stranger.get("/who").status_code == 401
        assert reader.get("/who", headers=bearer(TOKENS["engine-all"])).json() == "t"
        assert reader.get("/who").json() == "r"  # the token was that request's only
    finally:
        certified.close()
        server.stop()
