"""The HTTP side of every kvtier service (health, readiness, metrics, stats, and the services'
own JSON endpoints): uvicorn in a background thread, stoppable, plus what every app shares:
credential checks (``HttpGuard``: a bearer token, or the client certificate the TLS handshake
verified), a request-body limit and deadline (``BodyLimit``), and limits on connections
(``server_config``).

Client certificates: uvicorn does not hand the peer's certificate to the app, so the HTTP
protocol (``_HeaderGuard``, below) reads it once per connection, after the handshake, and
wraps that connection's app so that each of its requests carries the certificate's identities
in its ASGI scope (``peer_identities``). They are the ones gRPC maps (common name, DNS and URI
subject alternative names) and go to ``Authenticator.principal`` the same way.

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
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvtier.core.auth import (
    Authenticator,
    Permission,
    Principal,
    bearer,
    peer_certificate_identities,
)
from kvtier.core.config.auth import TlsConfig
from kvtier.core.errors import ErrorCode, KvtierError

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

# the ASGI scope key of the verified client certificate's identities (set by the server
# only: nothing a client sends can put a key in the scope)
PEER_IDENTITIES = "kvtier.peer_identities"

log = logging.getLogger(__name__)
_DISCONNECT: Message = {"type": "http.disconnect"}


def peer_identities(scope: Scope) -> tuple[str, ...]:
    """The identities (common name, DNS and URI subject alternative names) of the client
    certificate the TLS handshake of this request's connection verified; empty without one
    (plaintext, TLS without ``auth.tls.ca_file``, or a server not built by ``server_config``)."""
    return tuple(scope.get(PEER_IDENTITIES, ()))


class HttpGuard:
    """FastAPI dependencies that admit a caller holding ``permission`` (401 without a known
    token or, without a token, a verified certificate a credential names; 403 with one that
    does not allow the call)."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def require(self, permission: Permission) -> Any:
        def check(request: Request, authorization: str | None = Header(None)) -> Principal:
            try:
                principal = self.authenticator.principal(
                    bearer(authorization), certificate=peer_identities(request.scope)
                )
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


class _WithPeer:
    """One connection's app: puts the identities of its verified client certificate in the
    scope of each of its requests (``peer_identities``), then calls the server's app."""

    def __init__(self, app: ASGIApp, identities: tuple[str, ...]) -> None:
        self.app = app
        self.identities = identities

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[PEER_IDENTITIES] = self.identities
        await self.app(scope, receive, send)


def _verified_identities(transport: asyncio.BaseTransport) -> tuple[str, ...]:
    """The identities of the certificate this connection's TLS handshake verified (asyncio
    and uvloop call ``connection_made`` once the handshake is done). ``getpeercert()`` is an
    empty dict or None unless a certificate was presented *and* verified against the
    server's CA (``server_config`` sets ``CERT_REQUIRED`` with ``auth.tls.ca_file``)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return ()
    try:
        peercert = ssl_object.getpeercert()
    except ValueError:  # no handshake (cannot happen after connection_made): no identity
        return ()
    return tuple(peer_certificate_identities(peercert))


class _HeaderGuard:
    """Mixed into uvicorn's HTTP protocol (httptools or h11, whichever uvicorn would pick):
    a header timer per request, a header size cap, the connection cap, and the verified
    client certificate's identities in each request's scope. Its settings are class
    attributes (``guarded_protocol`` makes a subclass per server)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections: int | None = MAX_CONNECTIONS
    # uvicorn's own attributes, used here
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    connections: set[Any]
    cycle: Any
    app: ASGIApp

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._cycle_before: Any = None
        super().connection_made(transport)  # type: ignore[misc]
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            _rate_limited_warning("HTTP: at %d connections, refusing more", self.max_connections)
            self._answer_and_close(503, "Service Unavailable", b"retry-after: 1\r\n")
            return
        # uvicorn's protocols (httptools, h11) build each request's scope themselves, but
        # read ``self.app`` (set per protocol instance, i.e. per connection) for every
        # request: wrapping it here puts this connection's certificate in all its scopes
        identities = _verified_identities(transport)
        if identities:
            self.app = _WithPeer(self.app, identities)
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
