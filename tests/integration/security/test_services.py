"""Protected mode, the index's credentials, mTLS, request limits, and secrets kept off the
command line: real processes over real sockets."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from kvtier.core.config.auth import TlsConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.testing.services import Service, _start, kvtier_argv, start_store

from support.certs import certificates
from support.secure_env import TOKENS, auth_env


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kvtier_argv(args),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("service", ["store", "index"])
def test_protected_mode_refuses_an_open_port_without_auth(service: str, tmp_path: Path) -> None:
    args = [service, "serve", "--grpc-host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0"]
    if service == "store":
        args += ["--run-dir", str(tmp_path), "--capacity", "16MiB"]
    out = _serve(args, {})
    assert out.returncode != 0
    assert "protected mode" in out.stderr and "auth.credentials" in out.stderr


def test_an_open_port_with_credentials_starts(tmp_path: Path) -> None:
    store = start_store(
        tmp_path, "16MiB", "open-node", remote=False, env=auth_env(),
        extra=("--grpc-host", "0.0.0.0"),
    )  # fmt: skip
    try:
        port = store.address.rsplit(":", 1)[1]
        with pytest.raises(KvtierError) as err:  # reached over the wire, refused without a token
            GrpcStoreClient(f"127.0.0.1:{port}", timeout_s=5)
        assert err.value.code is ErrorCode.UNAUTHENTICATED
        client = GrpcStoreClient(f"127.0.0.1:{port}", 5, auth=ClientAuth(TOKENS["engine-all"]))
        assert client.info().node_id == "open-node"
        client.close()
    finally:
        store.stop()


SECRET = re.compile(r"^(auth_)?(token|bearer|secret|password|api_key|credentials?)(_file)?$")


def test_no_cli_option_takes_a_secret() -> None:
    """Secrets travel in files or the environment: a flag would show in ``ps``."""
    from kvtier.cli import app

    command = typer.main.get_command(app)
    stack: list[Any] = [command]
    seen = 0
    while stack:
        cmd = stack.pop()
        stack += list(getattr(cmd, "commands", {}).values())
        for param in cmd.params:
            seen += 1
            # "--tokens" is a prompt's token ids; a secret would be token/secret/password/key
            assert not SECRET.search(param.name.lower()), (cmd.name, param.name)
    assert seen > 20


@pytest.fixture(scope="module")
def secure_index() -> Iterator[Service]:
    index = _start(
        ["index", "serve", "--grpc-port", "0", "--http-port", "0"], auth_env(TOKENS["index"])
    )
    try:
        yield index
    finally:
        index.stop()


def _http(url: str, token: str | None = None, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if body:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_index_follows_only_authenticated_announcers(secure_index: Service) -> None:
    """Announcing makes the index dial the announced endpoint: only engines and nodes may."""
    registration = Registration("intruder", LocationKind.NODE, endpoints={"store": "10.9.9.9:1"})
    for token, code in (
        (None, ErrorCode.UNAUTHENTICATED),
        (TOKENS["reader"], ErrorCode.PERMISSION_DENIED),
    ):
        client = GrpcIndexClient(secure_index.address, 5, auth=ClientAuth(token))
        with pytest.raises(KvtierError) as err:
            client.register(registration)
        assert err.value.code is code
        client.close()
    admin = GrpcIndexClient(secure_index.address, 5, auth=ClientAuth(TOKENS["admin"]))
    assert "intruder" not in {i.registration.location for i in admin.locations()}
    admin.close()


def test_index_http_needs_credentials(secure_index: Service) -> None:
    http = secure_index.http
    assert _http(f"{http}/healthz") == 200
    assert _http(f"{http}/locations") == 401
    assert _http(f"{http}/locations", TOKENS["reader"]) == 200
    assert _http(f"{http}/namespaces", TOKENS["engine-a"]) == 403  # every tenant's: not engines
    assert _http(f"{http}/namespaces", TOKENS["reader"]) == 200  # a router needs them
    query = json.dumps({"ns": "00" * 16, "keys": []}).encode()
    assert _http(f"{http}/query", None, query) == 401
    assert _http(f"{http}/query", TOKENS["reader"], query) == 404  # let in: no such namespace


def test_oversized_body_is_refused_and_the_index_keeps_serving(secure_index: Service) -> None:
    """Refused on its Content-Length, before a byte of it is read."""
    host, port = secure_index.ready["http"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/query")
    conn.putheader("Authorization", f"Bearer {TOKENS['reader']}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 << 20))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and b"request body over" in response.read()
    conn.close()
    query = json.dumps({"ns": "00" * 16, "keys": []}).encode()
    assert _http(f"{secure_index.http}/query", TOKENS["reader"], query) == 404


def test_mtls_admits_only_certified_clients(tmp_path: Path) -> None:
    certs = certificates(tmp_path)
    env = {
        "KVTIER_AUTH__TLS__CERT_FILE": str(certs["server.crt"]),
        "KVTIER_AUTH__TLS__KEY_FILE": str(certs["server.key"]),
        "KVTIER_AUTH__TLS__CA_FILE": str(certs["ca.crt"]),
        **auth_env(),
    }
    store = start_store(tmp_path / "run", "16MiB", "tls-node", remote=False, env=env)
    try:
        with_cert = TlsConfig(
            cert_file=certs["client.crt"], key_file=certs["client.key"], ca_file=certs["ca.crt"]
        )
        no_cert = TlsConfig(ca_file=certs["ca.crt"])
        token = TOKENS["engine-all"]
        good = GrpcStoreClient(store.address, 5, auth=ClientAuth(token, with_cert))
        assert good.info().node_id == "tls-node"
        good.close()
        for auth in (ClientAuth(token, no_cert), ClientAuth(token)):  # no cert / plaintext
            with pytest.raises(KvtierError) as err:
                GrpcStoreClient(store.address, 5, auth=auth)
            assert err.value.code is ErrorCode.UNAVAILABLE
    finally:
        store.stop()


def test_authenticated_store_and_index_follow_each_other(tmp_path: Path) -> None:
    """The store announces itself with a node token; the index follows it with an index
    token; an engine's chunks reach the index; a reader sees them."""
    import time

    import numpy as np

    from kvtier.core.keys import Namespace, prompt_keys
    from kvtier.tiers.cpu import CpuTier

    index = _start(
        ["index", "serve", "--grpc-port", "0", "--http-port", "0"], auth_env(TOKENS["index"])
    )
    store = start_store(
        tmp_path, "16MiB", "followed-node", remote=False, env=auth_env(TOKENS["node"]),
        extra=("--index", index.address),
    )  # fmt: skip
    try:
        ns = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
        keys = prompt_keys(ns, np.arange(4 * ns.chunk_tokens, dtype=np.uint32))
        engine = GrpcStoreClient(store.address, 5, auth=ClientAuth(TOKENS["engine-all"]))
        with CpuTier(engine) as tier:
            ns_id = tier.register_namespace(ns, 4096)
            tier.put(ns_id, keys, [np.zeros(4096, np.uint8)] * len(keys))
        request = urllib.request.Request(f"{index.http}/locations")
        request.add_header("Authorization", f"Bearer {TOKENS['reader']}")
        deadline = time.monotonic() + 60
        entries = 0
        while time.monotonic() < deadline and entries < len(keys):
            with urllib.request.urlopen(request, timeout=5) as resp:
                for location in json.loads(resp.read()):
                    if location["location"] == "followed-node":
                        entries = location["entries"].get("cpu", 0)
            time.sleep(0.2)
        assert entries == len(keys)
    finally:
        store.stop()
        index.stop()
