"""An index process with credentials on (memory or Redis backend), its clients by role, and
what the insider tests look at: HTTP answers, threads and memory of the process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace, salt_digest
from kvtier.core.rpc import ClientAuth
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.services import Service, _start

from support.secure_env import SALTS, TOKENS, auth_env


def namespace(salt: str | None, model: str = "m") -> Namespace:
    """A small namespace of a tenant (``salt``: its raw cache_salt; None: unsalted)."""
    return Namespace(
        model=model, dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=16,
        cache_salt=salt_digest(salt),
    )  # fmt: skip


NS_A, NS_B = namespace(SALTS["a"]), namespace(SALTS["b"])


def start_index(
    *extra: str,
    redis_url: str | None = None,
    prefix: str | None = None,
    env: dict[str, str] | None = None,
) -> Service:
    """``kvtier index serve`` presenting the index token, knowing every credential and the
    tenants a and b; fast probes. ``redis_url``: the Redis backend, under ``prefix`` (default:
    a prefix of its own)."""
    args = ["index", "serve", "--grpc-port", "0", "--http-port", "0", "--probe-interval", "0.2"]
    if redis_url is not None:
        prefix = prefix or f"t:{uuid.uuid4().hex[:8]}:"
        args += ["--backend", "redis", "--redis-url", redis_url, "--redis-prefix", prefix]
    return _start([*args, *extra], {**auth_env(TOKENS["index"]), **(env or {})})


def client(index: Service, who: str) -> GrpcIndexClient:
    return GrpcIndexClient(index.address, 10, auth=ClientAuth(TOKENS[who]))


def refused(fn, *args, **kwargs) -> KvtierError:
    """The error ``fn(*args)`` raises (it must raise one)."""
    try:
        fn(*args, **kwargs)
    except KvtierError as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} was not refused")


def http(url: str, token: str | None = None, body: object | None = None) -> tuple[int, str]:
    """GET (or POST ``body`` as JSON) with a bearer token: (status, body text)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def readyz(index: Service) -> tuple[int, dict]:
    status, text = http(f"{index.http}/readyz")
    return status, json.loads(text)


def threads(pid: int) -> int:
    return int(_status_field(pid, "Threads"))


def rss_bytes(pid: int) -> int:
    return int(_status_field(pid, "VmRSS").split()[0]) << 10


def _status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(name)
