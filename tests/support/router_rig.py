"""What the router's security tests share: a router as a real process (``kvtier router serve``),
an index as one, an HTTP server that counts every request it is sent (the attacker's, or a
slow instance), and reading the router's /metrics and /readyz."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from kvtier.core.keys import Namespace
from kvtier.index.api import LocationKind, Registration
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.services import Service, _start

from support.secure_env import credentials

CLIENT_TOKEN = "client-token-0123456789"  # role client: may send requests through the router


def router_credentials() -> str:
    """Every role of secure_env, plus an API client's."""
    client = {"name": "app", "token": CLIENT_TOKEN, "role": "client", "tenants": []}
    return json.dumps([*credentials(), client])


def start_index(env: dict[str, str] | None = None) -> Service:
    """An index whose locations stay up without heartbeats for the test's length."""
    env = {"KVTIER_INDEX__HEARTBEAT_TIMEOUT_S": "600", **(env or {})}
    return _start(["index", "serve", "--grpc-port", "0", "--http-port", "0"], env)


def start_router(args: list[str], env: dict[str, str] | None = None) -> Service:
    return _start(["router", "serve", "--port", "0", *args], env)


@contextlib.contextmanager
def router_over_announced(
    api_url: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Service, Service]]:
    """(index, router): an index where the instance "inst" at ``api_url`` is announced with a
    namespace (so token ids become chunk keys the router asks about), and a router that
    discovered it and is ready (``env``: its configuration). Stopped on exit (the index with
    SIGCONT first)."""
    index = start_index()
    router: Service | None = None
    try:
        client = GrpcIndexClient(index.address, 5)
        ns = Namespace(model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8)
        ns_id = client.register_namespace(ns)
        client.register(
            Registration(
                "inst", LocationKind.INSTANCE, namespaces=(ns_id,), endpoints={"api": api_url}
            )
        )
        client.close()
        router = start_router(["--index", index.address], env)
        url = router_url(router)
        wait_for(lambda: httpx.get(f"{url}/readyz").status_code == 200, what="router ready")
        yield index, router
    finally:
        if router is not None:
            router.stop()
        index.stop()


def router_url(router: Service) -> str:
    scheme = "https" if router.ready.get("tls") else "http"
    return f"{scheme}://{router.ready['http']}"


def metric(url: str, name: str, **kw: object) -> float:
    """The sum of a metric's samples whose line starts with ``name`` (labels included)."""
    text = httpx.get(f"{url}/metrics", timeout=5, **kw).text  # type: ignore[arg-type]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def wait_for(check: Callable[[], bool], timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout} s: {what}")


@dataclass
class Recorded:
    requests: list[str] = field(default_factory=list)  # "METHOD path"
    lock: threading.Lock = field(default_factory=threading.Lock)


class Recorder:
    """A plain HTTP server on loopback answering every request like a vLLM instance would
    (200, a completion), and recording each: what the router sends it, probes included."""

    def __init__(self) -> None:
        self.seen = Recorded()
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                with seen.lock:
                    seen.requests.append(f"{self.command} {self.path}")
                body = b'{"data": [{"id": "stub"}], "choices": [{"text": "stolen"}]}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def count(self) -> int:
        with self.seen.lock:
            return len(self.seen.requests)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
