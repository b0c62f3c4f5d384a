"""The HTTP side of every kvtier service (health, readiness, metrics, stats, and the services'
own JSON endpoints): uvicorn in a background thread, stoppable, plus what every app shares:
bearer-token checks (``HttpGuard``), a request-body limit and deadline (``BodyLimit``), and
limits on connections (``server_config``).

What a client can hold, and for how long (slowloris: a client that opens connections and
sends each request slowly, or never finishes it, until the server has no file descriptors):
- a request's header must arrive whole within ``header_timeout_s`` and ``MAX_HEADER_BYTES``;
  uvicorn has no such timer (its keep-alive timer runs only between requests), so the HTTP
  protocol is subclassed (``_HeaderGuard``) to arm one per request;
- its body within ``body_timeout_s`` of the app starting to read it (408), and no more than
  ``body_limit`` bytes (413, by Content-Length or while a chunked body streams in);
- at most ``max_connections`` connections at once: beyond, a new one is answered 503 and
  closed before a byte of it is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvtier.auth import Authenticator, Permission, Principal, bearer
from kvtier.config_auth import TlsConfig
from kvtier.errors import ErrorCode, KvtierError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]  # (status, message) -> a response body (JSON)

BODY_LIMIT = 1 << 20  # bytes of one request body (the largest is a /query batch)
HEADER_TIMEOUT_S = 10.0  # a request's header (line + fields) must arrive within this
BODY_TIMEOUT_S = 60.0  # a request's body, once the app reads it
MAX_CONNECTIONS = 1024  # client connections at once
MAX_HEADER_BYTES = 64 << 10  # a request's header (uvicorn's h11 default is 16 KiB)

log = logging.getLogger(__name__)
_DISCONNECT: Message = {"type": "http.disconnect"}


class HttpGuard:
    """FastAPI dependencies that admit a caller holding ``permission`` (401 without a known
    token, 403 with one that does not allow the call)."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def require(self, permission: Permission) -> Any:
        def check(authorization: str | None = Header(None)) -> Principal:
            try:
                principal = self.authenticator.principal(bearer(authorization))
                principal.require(permission, f"read {permission}")
            except KvtierError as exc:
                unauthenticated = exc.code is ErrorCode.UNAUTHENTICATED
                raise HTTPException(
                    401 if unauthenticated else 403,
                    exc.message,
                    headers={"WWW-Authenticate": "Bearer"} if unauthenticated else None,
                ) from None
            return principal

        return Depends(check)


def detail_body(status: int, message: str) -> bytes:
    """FastAPI's error shape: ``{"detail": message}``."""
    return json.dumps({"detail": message}).encode()


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before the app
    sees it (by its Content-Length, or while it streams in without one); one that does not
    arrive within ``timeout_s`` of the app starting to read it, 408. Either way the app then
    reads a disconnect, its own answer is dropped, and the connection is closed."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int = BODY_LIMIT,
        timeout_s: float | None = None,
        error_body: ErrorBody = detail_body,
    ) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(send, 413, f"request body over {self.limit} bytes")
            return
        loop = asyncio.get_running_loop()
        seen = 0
        deadline: float | None = None
        body_done = False
        started = refused = cut = False  # the app answered / we did / the app was cut off

        async def refuse(status: int, message: str) -> Message:
            nonlocal refused, cut
            cut = True
            if not started:  # (an app answering before reading its body: just cut off)
                refused = True
                await self._refuse(send, status, message)
            return _DISCONNECT

        async def limited() -> Message:
            nonlocal seen, deadline, body_done
            if cut:
                return _DISCONNECT
            if body_done:  # after the body: a wait for the client's disconnect
                return await receive()
            if self.timeout_s is None:
                message = await receive()
            else:
                deadline = deadline or loop.time() + self.timeout_s
                try:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                except TimeoutError:
                    return await refuse(408, f"request body not received in {self.timeout_s} s")
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await refuse(413, f"request body over {self.limit} bytes")
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the app's answer to a request already refused
            started = True
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not refused:
                raise  # (refused: the app failed reading a body it was told was gone)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        body = self.error_body(status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the rest of the body is never read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _HeaderGuard:
    """Mixed into uvicorn's HTTP protocol (httptools or h11, whichever uvicorn would pick):
    a header timer per request, a header size cap, and the connection cap. Its settings are
    class attributes (``guarded_protocol`` makes a subclass per server)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections: int | None = MAX_CONNECTIONS
    # uvicorn's own attributes, used here
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]
    cycle: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._cycle_before: Any = None
        super().connection_made(transport)  # type: ignore[misc]
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            _rate_limited_warning("HTTP: at %d connections, refusing more", self.max_connections)
            self._answer_and_close(503, "Service Unavailable", b"retry-after: 1\r\n")
            return
        self._await_header()

    def _await_header(self) -> None:
        self._header_bytes = 0
        self._cycle_before = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_late)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._await_header()  # the next request on a kept-alive connection
        super().data_received(data)  # type: ignore[misc]
        if self._header_timer is None:
            return
        if self.cycle is not self._cycle_before:  # a new request's header is complete
            self._stop_timer()
        else:
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._answer_and_close(431, "Request Header Fields Too Large")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _header_late(self) -> None:
        self._header_timer = None
        if self.cycle is self._cycle_before:  # still no whole header
            self._answer_and_close(408, "Request Timeout")

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _answer_and_close(self, status: int, reason: str, extra: bytes = b"") -> None:
        self._stop_timer()
        if self.transport.is_closing():
            return
        head = f"HTTP/1.1 {status} {reason}\r\nconnection: close\r\ncontent-length: 0\r\n"
        self.transport.write(head.encode() + extra + b"\r\n")
        self.transport.close()


def guarded_protocol(
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections: int | None = MAX_CONNECTIONS,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with ``_HeaderGuard``'s limits (pass it as ``http=``)."""
    settings = {
        "header_timeout_s": header_timeout_s,
        "max_connections": max_connections,
        "max_header_bytes": max_header_bytes,
    }
    return type("GuardedHTTPProtocol", (_HeaderGuard, AutoHTTPProtocol), settings)


_warned_at: dict[str, float] = {}


def _rate_limited_warning(message: str, *args: Any) -> None:
    """At most one a minute per message (a flood of refusals is one event)."""
    now = asyncio.get_running_loop().time()
    if now - _warned_at.get(message, -60.0) >= 60.0:
        _warned_at[message] = now
        log.warning(message, *args)


def server_config(
    app: ASGIApp,
    host: str,
    port: int,
    tls: TlsConfig | None = None,
    body_limit: int = BODY_LIMIT,
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float | None = BODY_TIMEOUT_S,
    max_connections: int | None = MAX_CONNECTIONS,
    error_body: ErrorBody = detail_body,
    log_level: str = "warning",
) -> uvicorn.Config:
    """uvicorn's config for ``app`` with kvtier's limits (module docstring); TLS (and client
    certificates with ``tls.ca_file``) when ``tls`` says so."""
    kwargs: dict[str, Any] = {}
    if tls is not None and tls.cert_file is not None:
        kwargs = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
        if tls.ca_file is not None:
            kwargs |= {"ssl_ca_certs": str(tls.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return uvicorn.Config(
        BodyLimit(app, body_limit, body_timeout_s, error_body),
        host=host,
        port=port,
        http=guarded_protocol(header_timeout_s, max_connections),
        log_level=log_level,
        access_log=False,
        **kwargs,
    )


class HttpServer:
    """uvicorn in a background thread, stoppable; TLS (and client certificates with
    ``tls.ca_file``) when ``tls`` says so; the limits of ``server_config``."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: TlsConfig | None = None,
        body_limit: int = BODY_LIMIT,
        *,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float | None = BODY_TIMEOUT_S,
        max_connections: int | None = MAX_CONNECTIONS,
    ) -> None:
        config = server_config(
            app,
            host,
            port,
            tls,
            body_limit,
            header_timeout_s=header_timeout_s,
            body_timeout_s=body_timeout_s,
            max_connections=max_connections,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvtier-http", daemon=True)

    def start(self, timeout: float = 10.0) -> int:
        """Start serving; returns the bound port."""
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.01)):
            if self._server.started:
                break
            if not self._thread.is_alive():
                raise RuntimeError("HTTP server failed to start (port in use?)")
            deadline.wait(0.01)
        else:
            raise RuntimeError("HTTP server did not start in time")
        return self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
