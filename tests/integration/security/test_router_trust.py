"""Where the router sends prompts, and who may talk to it: an engine credential cannot point
the router at a server of its own by announcing it to the index (only instances the
configuration lists or ``router.discover_allow`` admits are routed to), and the router serves
TLS, with client certificates, as ``auth.tls`` says. Real processes over real sockets."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.core.rpc import ClientAuth
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.services import Service

from support.certs import certificates
from support.router_rig import (
    CLIENT_TOKEN,
    Recorder,
    metric,
    router_credentials,
    router_url,
    start_index,
    start_router,
    wait_for,
)
from support.secure_env import TOKENS, auth_env
from support.stub_backend import StubBackend

BODY = {"model": "stub", "prompt": [1, 2, 3, 4], "max_tokens": 1}
CLIENT = {"Authorization": f"Bearer {CLIENT_TOKEN}"}


def announce(index: Service, token: str | None, name: str, api: str) -> None:
    """What an engine holding ``token`` may do: register an instance location."""
    client = GrpcIndexClient(index.address, 5, auth=ClientAuth(token))
    try:
        client.register(Registration(name, LocationKind.INSTANCE, endpoints={"api": api}))
    finally:
        client.close()


def router_env() -> dict[str, str]:
    """A router with credentials (clients need a token), reading the index as a reader."""
    return {
        **auth_env(TOKENS["reader"]),
        "KVTIER_AUTH__CREDENTIALS": router_credentials(),
        "KVTIER_ROUTER__POLICY": "round-robin",  # the attacker would get every other request
    }


def readyz(url: str, **kw: object) -> dict:
    return httpx.get(f"{url}/readyz", timeout=5, **kw).json()  # type: ignore[arg-type]


@pytest.fixture
def secure_index() -> Iterator[Service]:
    index = start_index(auth_env(TOKENS["index"]))
    try:
        yield index
    finally:
        index.stop()


@pytest.fixture
def parties() -> Iterator[tuple[StubBackend, Recorder]]:
    """A legitimate instance, and the attacker's server."""
    legit, attacker = StubBackend("legit"), Recorder()
    try:
        yield legit, attacker
    finally:
        legit.stop()
        attacker.stop()


def test_an_engine_cannot_announce_its_own_server_to_the_router(
    secure_index: Service, parties: tuple[StubBackend, Recorder]
) -> None:
    """Tenant b's engine announces an instance whose API is its own server; the router, whose
    discover_allow names where the fleet's instances run, never sends it a byte."""
    legit, attacker = parties
    announce(secure_index, TOKENS["engine-a"], "legit", legit.url)
    announce(secure_index, TOKENS["engine-b"], "evil", attacker.url)  # allowed to announce
    allow = f"127.0.0.1:{legit.port}"  # where the fleet runs (router.discover_allow)
    args = ["--index", secure_index.address, "--discover-allow", allow]
    router = start_router(args, router_env())
    url = router_url(router)
    try:
        wait_for(lambda: readyz(url).get("backends") == 1, what="the router sees the fleet")
        for _ in range(6):
            resp = httpx.post(f"{url}/v1/completions", json=BODY, headers=CLIENT, timeout=10)
            assert resp.status_code == 200 and resp.json()["served_by"] == "legit"
        time.sleep(2.5)  # a refresh, scrapes and probes later: still nothing for the attacker
        assert attacker.count() == 0, attacker.seen.requests
        assert len(legit.state.received) == 6
        assert readyz(url)["backends"] == 1
        assert metric(url, "kvtier_router_discovery_refused_total") == 1  # once, not per refresh
    finally:
        router.stop()


def test_with_credentials_and_no_allow_list_only_configured_instances_serve(
    secure_index: Service, parties: tuple[StubBackend, Recorder]
) -> None:
    """Unset discover_allow with credentials on: announcements admit nothing (each one is
    refused and counted), the instances listed in the configuration serve."""
    legit, attacker = parties
    announce(secure_index, TOKENS["engine-b"], "evil", attacker.url)
    router = start_router(["--index", secure_index.address, "--backend", legit.url], router_env())
    url = router_url(router)
    try:
        for _ in range(4):
            resp = httpx.post(f"{url}/v1/completions", json=BODY, headers=CLIENT, timeout=10)
            assert resp.status_code == 200 and resp.json()["served_by"] == "legit"
        time.sleep(2.5)
        assert attacker.count() == 0, attacker.seen.requests
        assert readyz(url)["backends"] == 1
        assert metric(url, "kvtier_router_discovery_refused_total") == 1
    finally:
        router.stop()


def test_anonymous_loopback_deployment_discovers_loopback_instances_only(
    parties: tuple[StubBackend, Recorder],
) -> None:
    """No credentials anywhere (``make run``): announced loopback instances are routed to as
    before; one announced beyond loopback is refused."""
    legit, _ = parties
    index = start_index()
    try:
        announce(index, None, "local", legit.url)
        announce(index, None, "far", "http://10.255.255.1:8000")
        router = start_router(["--index", index.address], {"KVTIER_ROUTER__POLICY": "round-robin"})
        url = router_url(router)
        try:
            wait_for(lambda: readyz(url).get("backends") == 1, what="the local instance")
            for _ in range(3):
                resp = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
                assert resp.status_code == 200 and resp.json()["served_by"] == "legit"
            assert metric(url, "kvtier_router_discovery_refused_total") == 1
            assert metric(url, 'kvtier_router_backends{state="known"}') == 1
        finally:
            router.stop()
    finally:
        index.stop()


def test_router_serves_tls_and_requires_client_certificates(tmp_path: Path) -> None:
    certs = certificates(tmp_path)
    stub = StubBackend("behind-tls")
    env = {
        **router_env(),
        "KVTIER_AUTH__TLS__CERT_FILE": str(certs["server.crt"]),
        "KVTIER_AUTH__TLS__KEY_FILE": str(certs["server.key"]),
        "KVTIER_AUTH__TLS__CA_FILE": str(certs["ca.crt"]),
    }
    router = start_router(["--backend", stub.url], env)
    hostport = router.ready["http"]
    try:
        with_cert = ssl.create_default_context(cafile=str(certs["ca.crt"]))
        with_cert.load_cert_chain(str(certs["client.crt"]), str(certs["client.key"]))
        with httpx.Client(verify=with_cert, timeout=10) as client:
            assert client.get(f"https://{hostport}/healthz").status_code == 200
            resp = client.post(f"https://{hostport}/v1/completions", json=BODY, headers=CLIENT)
            assert resp.status_code == 200 and resp.json()["served_by"] == "behind-tls"
        no_cert = ssl.create_default_context(cafile=str(certs["ca.crt"]))
        with httpx.Client(verify=no_cert, timeout=10) as client, pytest.raises(httpx.HTTPError):
            client.get(f"https://{hostport}/healthz")  # handshake refused: no certificate
        with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
            httpx.get(f"http://{hostport}/healthz", timeout=10)
        assert router.ready.get("tls") is True
    finally:
        router.stop()
        stub.stop()
