"""What goes back to the client: an instance's answer, relayed and counted (``AnswerRelay``),
and the router's own answers in the OpenAI error shape (``error``, ``error_body``).

A stream is relayed byte for byte; after its first byte nothing is retried (sampling is not
deterministic), so a stream that breaks ends with an SSE ``error`` event, after the bytes
aiohttp still buffered (``_still_buffered``). A non-streamed answer comes whole, at its end:
until then the client's connection is watched (``unless_gone``), and the client leaving
cancels the upstream request. Whichever way an answer ends, its instance's load is released
and the routing decision's outcome logged. The request's side (parsing, routing, retries
before the first byte): ``proxy.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import aiohttp
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.router.backends import Backend
from kvtier.router.core import Routed, RoutingCore
from kvtier.router.metrics import RouterMetrics

T = TypeVar("T")

# what forwarding to an instance raises for the instance's failure (refused, reset, timed out)
FORWARD_ERRORS = (aiohttp.ClientError, TimeoutError)
INSTANCE_HEADER = "x-kvtier-instance"  # which instance answered (debugging, the demo)


def error(status: int, message: str, kind: str, retry_after: float | None = None) -> Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(status: int, message: str) -> bytes:
    """The OpenAI error shape, for answers the HTTP layer gives (413, 408: ``BodyLimit``)."""
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    ).encode()


class AnswerRelay:
    """Hands an instance's answer (its response, headers read) to the client: TTFT, TPOT and
    E2E observed, the instance's load released, the decision's outcome logged."""

    def __init__(self, core: RoutingCore, metrics: RouterMetrics) -> None:
        self.core = core
        self.backends = core.backends
        self.metrics = metrics

    def stream(
        self, upstream: aiohttp.ClientResponse, backend: Backend, routed: Routed, start: float
    ) -> StreamingResponse:
        return StreamingResponse(
            self._relay(upstream, backend, routed, start),
            status_code=upstream.status,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
            headers={INSTANCE_HEADER: backend.name},
        )

    async def _relay(
        self, upstream: aiohttp.ClientResponse, backend: Backend, routed: Routed, start: float
    ) -> AsyncIterator[bytes]:
        got_first = False
        last_chunk = 0.0
        outcome = "ok"
        try:
            async for chunk in upstream.content.iter_any():
                now = time.perf_counter()
                if not got_first:
                    got_first = True
                    self.metrics.ttft.observe(now - start)
                    self.backends.first_token(backend, routed.prompt_tokens)
                else:
                    self.metrics.tpot.observe(now - last_chunk)
                last_chunk = now
                self._realized(chunk)
                yield chunk
        except FORWARD_ERRORS as exc:  # after bytes went out: no retry, say so in the stream
            outcome = f"stream failed: {exc!r}"
            left = _still_buffered(upstream.content)
            if left:  # tokens the engine sent before it broke: the client gets them first
                self._realized(left)
                yield left
            self.metrics.stream_errors.inc()
            if self.backends.eject(backend, "stream failed"):
                self.metrics.ejections.labels("stream").inc()
            event = {"error": {"message": f"instance failed mid-stream: {exc!r}", "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client went away"
            raise
        finally:
            upstream.close()  # cancels the upstream request if it is still running
            self.backends.finished(backend, routed.prompt_tokens, got_first)
            self.metrics.e2e.observe(time.perf_counter() - start)
            self.core.log_decision(routed, {"outcome": outcome, "stream": True})

    async def whole(
        self,
        request: Request,
        upstream: aiohttp.ClientResponse,
        backend: Backend,
        routed: Routed,
        start: float,
    ) -> Response:
        """A non-streamed answer; the client leaving cancels it."""
        try:
            content = await unless_gone(request, upstream.read())
        except ClientGone:
            self.core.log_decision(routed, {"outcome": "client went away"})
            return Response(status_code=499)
        except FORWARD_ERRORS as exc:
            self.backends.eject(backend, "read failed")
            return error(502, f"instance {backend.name} failed: {exc!r}", "upstream_error")
        finally:
            # read whole, its connection went back to the pool already; otherwise this drops
            # it, and the instance sees the request cancelled
            upstream.close()
            self.backends.finished(backend, routed.prompt_tokens, got_first_token=False)
        elapsed = time.perf_counter() - start
        self.metrics.ttft.observe(elapsed)
        self.metrics.e2e.observe(elapsed)
        self._realized(content)
        self.core.log_decision(routed, {"outcome": "ok", "status": upstream.status})
        return Response(
            content,
            upstream.status,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers={INSTANCE_HEADER: backend.name},
        )

    def _realized(self, data: bytes) -> None:
        """Cached tokens vLLM reports in ``usage`` (in a JSON answer or a stream's last event)."""
        if b'"cached_tokens"' not in data:
            return
        for part in data.split(b"data: ") if data.startswith(b"data: ") else [data]:
            try:
                usage = json.loads(part.strip() or b"{}").get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            except (ValueError, AttributeError):
                continue
            if cached:
                self.metrics.realized_cached.inc(cached)


def _still_buffered(content: aiohttp.StreamReader) -> bytes:
    """What aiohttp received before the connection broke and has not handed out yet.

    Its reader raises a broken transfer before the data buffered with it (``readany``
    checks the exception first), so the last bytes an engine sent right before dying would
    be lost to the client. aiohttp offers no public read past the exception: this takes
    its buffer by the private ``_read_nowait`` (aiohttp 3.x), and gives nothing where
    that is not there.
    """
    try:
        if not getattr(content, "_buffer", None):
            return b""
        return bytes(content._read_nowait(-1))
    except Exception:  # another aiohttp: the bytes are lost, the error event still goes
        return b""


class ClientGone(Exception):
    """The client disconnected while the router waited on its behalf."""


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (an httpx
    request closes its connection: the instance sees the disconnect) and ``ClientGone``
    raised. The body has been read whole by now, so the next ASGI message is the
    disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are cancelled ourselves (shutdown): so is the work
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)  # (a late empty body chunk)
