"""The HTTP side of every kvtier service (health, readiness, metrics, stats, and the services'
own JSON endpoints): uvicorn in a background thread, stoppable, plus what every app shares:
bearer-token checks (``HttpGuard``) and a request-body limit (``BodyLimit``)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException

from kvtier.auth import Authenticator, Permission, Principal, bearer
from kvtier.config_auth import TlsConfig
from kvtier.errors import ErrorCode, KvtierError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_LIMIT = 1 << 20  # bytes of one request body (the largest is a /query batch)


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


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before the app
    sees it (by its Content-Length, or while it streams in without one)."""

    def __init__(self, app: ASGIApp, limit: int = BODY_LIMIT) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _too_large(send, self.limit)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(send, self.limit)


class _BodyTooLarge(Exception):
    pass


async def _too_large(send: Send, limit: int) -> None:
    body = f'{{"detail":"request body over {limit} bytes"}}'.encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HttpServer:
    """uvicorn in a background thread, stoppable; TLS (and client certificates with
    ``tls.ca_file``) when ``tls`` says so."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: TlsConfig | None = None,
        body_limit: int = BODY_LIMIT,
    ) -> None:
        kwargs: dict[str, Any] = {}
        if tls is not None and tls.cert_file is not None:
            kwargs = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
            if tls.ca_file is not None:
                kwargs |= {"ssl_ca_certs": str(tls.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            BodyLimit(app, body_limit),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            **kwargs,
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
