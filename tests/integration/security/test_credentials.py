"""Credentials as an attacker meets them: requests refused before they cost memory, malformed
bodies answered without a traceback each, certificates that map to a role (and a CA file that
is not a credential), secrets kept out of config errors and off other users' reach. Real
processes over real sockets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvtier.core.config.auth import TlsConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.core.rpc import ClientAuth, channel_options
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.testing.services import Service, kvtier_argv, start_store

from support.certs import Authority
from support.secure_env import TOKENS, SecureStore, auth_env, credentials

STORE = "/kvtier.store.v1.Store"


def _raw_call(address: str, method: str, body: bytes, token: str | None = None) -> grpc.StatusCode:
    """Send ``body`` as the request of ``method`` exactly as given (no serializer)."""
    channel = grpc.insecure_channel(address, options=channel_options())
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        channel.unary_unary(f"{STORE}/{method}")(body, timeout=30, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined]
    finally:
        channel.close()


def _memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak since start) of ``pid``, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def test_unauthenticated_large_request_is_refused_before_it_is_parsed(
    secure_store: SecureStore,
) -> None:
    """60 MiB of packed ``sizes`` (one byte each on the wire, eight once parsed) with no
    token: refused UNAUTHENTICATED without the store parsing, or even holding, the body.
    Before the fix these two calls grew the store's peak RSS by over 1 GiB (now ~10 MiB)."""
    length = 60 << 20
    varint = bytearray()
    n = length
    while n >= 0x80:
        varint.append((n & 0x7F) | 0x80)
        n >>= 7
    varint.append(n)
    body = b"\x22" + bytes(varint) + b"\x01" * length  # AllocateRequest.sizes (field 4)
    pid = secure_store.service.proc.pid
    before = _memory_mib(pid)
    assert _raw_call(secure_store.address, "Allocate", body) == grpc.StatusCode.UNAUTHENTICATED
    assert _raw_call(secure_store.address, "Allocate", body, "not-a-token-0123456789") == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    after = _memory_mib(pid)
    assert after["VmHWM"] - before["VmHWM"] < 100, (before, after)
    assert after["VmRSS"] - before["VmRSS"] < 100, (before, after)


# -- malformed requests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def logged_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    """A secure store whose stderr (its log) goes to a file the test reads."""
    run_dir = tmp_path_factory.mktemp("logged-store")
    stderr = run_dir / "stderr.log"
    service = start_store(
        run_dir, "16MiB", "logged-node", remote=False, env=auth_env(TOKENS["node"]),
        wrapper=("sh", "-c", 'exec "$@" 2>"$0"', str(stderr)),
    )  # fmt: skip
    try:
        yield service, stderr
    finally:
        service.stop()


# a length-delimited field 1 claiming 2^28 bytes, with 3 present: no protobuf parser accepts it
GARBAGE = b"\x0a\x80\x80\x80\x80\x01abc"


@pytest.mark.parametrize(
    ("method", "token"),
    [("Lookup", TOKENS["engine-all"]), ("Prove", None)],  # Prove is open to anyone
)
def test_malformed_request_is_invalid_argument_and_logged_once(
    logged_store: tuple[Service, Path], method: str, token: str | None
) -> None:
    store, stderr = logged_store
    seen = len(stderr.read_text().splitlines())
    codes = {_raw_call(store.address, method, GARBAGE, token) for _ in range(50)}
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    time.sleep(0.5)  # let the store's log reach the file
    lines = stderr.read_text().splitlines()[seen:]
    assert len(lines) <= 1, lines
    assert not any("Traceback" in line for line in lines)


# -- certificates as credentials -------------------------------------------------------------


def _tls_env(ca: Authority, extra_credentials: list[dict]) -> dict[str, str]:
    cert, key = ca.server()
    env = auth_env()
    env["KVTIER_AUTH__CREDENTIALS"] = json.dumps([*credentials(), *extra_credentials])
    return {
        **env,
        "KVTIER_AUTH__TLS__CERT_FILE": str(cert),
        "KVTIER_AUTH__TLS__KEY_FILE": str(key),
        "KVTIER_AUTH__TLS__CA_FILE": str(ca.cert_file),
    }


def test_a_certificate_alone_authenticates_as_its_credential(tmp_path: Path) -> None:
    """mTLS without a bearer token: the verified certificate's identity (a URI SAN here, a
    common name for the admin) names the credential, and with it the role."""
    ca = Authority(tmp_path)
    env = _tls_env(
        ca,
        [
            {"name": "node-1", "role": "node", "tls_identity": "spiffe://kvtier/node-1"},
            {"name": "ops", "role": "admin", "tls_identity": "ops.kvtier"},
        ],
    )
    store = start_store(tmp_path / "run", "16MiB", "cert-node", remote=False, env=env)

    def client(name: str, common_name: str, uris: tuple[str, ...] = (), token: str | None = None):
        cert, key = ca.issue(name, common_name, uris=uris)
        tls = TlsConfig(cert_file=cert, key_file=key, ca_file=ca.cert_file)
        return GrpcStoreClient(store.address, 5, auth=ClientAuth(token, tls))

    try:
        node = client("node-1", "some host", uris=("spiffe://kvtier/node-1",))
        ns = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
        keys = prompt_keys(ns, np.arange(2 * ns.chunk_tokens, dtype=np.uint32))
        ns_id = node.register_namespace(ns, 4096)
        assert node.lookup(ns_id, keys).hits == []  # node calls: data ...
        with pytest.raises(KvtierError) as err:  # ... and serving peers: admitted, then told
            node.lease_for_peer(ns_id, keys)  # this store has no remote tier
        assert err.value.code is ErrorCode.UNAVAILABLE, err.value
        for refused in (node.clear, node.stats):  # admin's and the index's: not a node's
            with pytest.raises(KvtierError) as err:
                refused()
            assert err.value.code is ErrorCode.PERMISSION_DENIED
        node.close()

        ops = client("ops", "ops.kvtier")  # by common name
        assert ops.clear() == 0
        ops.close()

        with pytest.raises(KvtierError) as err:  # signed by the CA, but named by no credential
            client("stranger", "stranger", uris=("spiffe://kvtier/stranger",))
        assert err.value.code is ErrorCode.UNAUTHENTICATED

        # a bearer token decides when one is presented: a stranger's certificate with an
        # engine token is that engine; with an unknown token it is nobody
        engine = client("stranger2", "x", token=TOKENS["engine-all"])
        with pytest.raises(KvtierError) as err:
            engine.lease_for_peer(ns_id, keys)
        assert err.value.code is ErrorCode.PERMISSION_DENIED
        engine.close()
        with pytest.raises(KvtierError) as err:
            client("node-1b", "y", ("spiffe://kvtier/node-1",), token="unknown-token-0123456789")
        assert err.value.code is ErrorCode.UNAUTHENTICATED
    finally:
        store.stop()


def _refused_start(tmp_path: Path, env: dict[str, str], host: str) -> str:
    """Start a store bound to ``host``; it must exit with an error: returns its stderr."""
    args = ["store", "serve", "--grpc-host", host, "--grpc-port", "0", "--http-port", "0"]
    args += ["--run-dir", str(tmp_path / "run"), "--capacity", "16MiB", "--no-remote"]
    proc = subprocess.Popen(
        kvtier_argv(args),
        env={**os.environ, "KVTIER_LOG_LEVEL": "warning", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()  # a "ready" line, or nothing when it exits
    if ready:
        Service(proc, json.loads(ready)).stop()
        pytest.fail(f"the store started on {host}: {ready}")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    return stderr


def test_a_ca_file_alone_does_not_satisfy_protected_mode(tmp_path: Path) -> None:
    """A CA file verifies client certificates only on a TLS listener, and then only a
    credential naming a certificate says who it is: neither alone lets a store bind 0.0.0.0."""
    ca = Authority(tmp_path)
    cert, key = ca.server()
    ca_only = {"KVTIER_AUTH__TLS__CA_FILE": str(ca.cert_file)}
    err = _refused_start(tmp_path, ca_only, "0.0.0.0")
    assert "protected mode" in err and "cert_file" in err, err

    mtls_nobody = {
        **ca_only,
        "KVTIER_AUTH__TLS__CERT_FILE": str(cert),
        "KVTIER_AUTH__TLS__KEY_FILE": str(key),
    }
    err = _refused_start(tmp_path, mtls_nobody, "0.0.0.0")
    assert "protected mode" in err and "tls_identity" in err, err

    # a credential naming a certificate, on a listener that verifies none: a config error
    cert_credential = json.dumps([{"name": "n", "role": "node", "tls_identity": "n.kvtier"}])
    err = _refused_start(
        tmp_path, {**ca_only, "KVTIER_AUTH__CREDENTIALS": cert_credential}, "127.0.0.1"
    )
    assert "tls_identity" in err and "key_file" in err, err


# -- secrets ---------------------------------------------------------------------------------

SALT = "tenant-salt-never-shown-7f3a"
SHORT_TOKEN = "tok-QW12-z9"  # under 16 characters: refused


def test_config_errors_do_not_echo_salts_or_tokens(tmp_path: Path) -> None:
    config = tmp_path / "kvtier.toml"
    config.write_text(
        f"""
[[store.tenants]]
name = "a"
cache_salts = "{SALT}"  # a string, not a list: invalid

[[auth.credentials]]
name = "short"
token = "{SHORT_TOKEN}"
role = "engine"
"""
    )
    out = subprocess.run(
        kvtier_argv(["store", "stats", "--config", str(config)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "cache_salts" in text and "token shorter than 16" in text, text  # said what is wrong
    for secret in (SALT, SHORT_TOKEN, SALT[-8:], SHORT_TOKEN[-5:]):
        assert secret not in text, text


def test_auth_init_makes_the_folder_and_every_token_private(tmp_path: Path) -> None:
    """Into a folder others can read, over token files others can read, with --force: the
    folder ends 0700 and every file 0600 (the new tokens never were readable by others)."""
    out = tmp_path / "secrets"
    out.mkdir()
    out.chmod(0o755)
    for name in ("credentials.toml", "admin.token", "node.token"):
        (out / name).write_text("old\n")
        (out / name).chmod(0o644)
    result = subprocess.run(
        kvtier_argv(["auth", "init", "--out", str(out), "--force"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    files = sorted(out.iterdir())
    assert {f.name for f in files} >= {"credentials.toml", "admin.token", "node.token"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert f.read_text() != "old\n"
