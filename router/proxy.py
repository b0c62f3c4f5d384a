"""The OpenAI-compatible front door's requests: ``/v1/completions``, ``/v1/chat/completions``
and ``/v1/models`` (the routes, with ``/healthz``, ``/readyz`` and ``/metrics``: ``http.py``).

A request is parsed and checked once (``requests.py``: 400 on a bad body, large ones off the
event loop), tokenized once (``tokenize.py``), routed (``core.py``) and forwarded with its
body untouched, except that a completion's text prompt is replaced by its token ids when the
router tokenized it. The answer goes back through ``responses.py`` (``AnswerRelay``): a
stream relayed byte for byte, a whole answer read while the client is watched.

Failure rules (docs/router.md):
- before the first byte, a connection error, a timeout or a 5xx ejects the instance and the
  request goes to another one, at most ``router.retries`` (2) times, never twice to the same;
- after the first byte nothing is retried (sampling is not deterministic): a stream that
  breaks ends with an SSE ``error`` event;
- no instance healthy: 503, all at ``max_in_flight``: 429, both with ``Retry-After``;
- the client going away cancels the upstream request (its generation stops): while the
  router waits for the instance's answer (a non-streamed one comes whole, at the end), the
  connection is watched for the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
from fastapi import Request, Response

from kvtier.core.auth import Authenticator, Permission, bearer
from kvtier.core.config.router import RouterConfig
from kvtier.core.errors import KvtierError
from kvtier.core.http import peer_identities
from kvtier.router.backends import Backend, NoBackend
from kvtier.router.core import Routed, RoutingCore
from kvtier.router.metrics import RouterMetrics
from kvtier.router.offload import PrefillOffload, prefill_only
from kvtier.router.requests import (
    CHAT_PATH,
    INLINE_BYTES,
    PARSE_SLOTS,
    BadRequest,
    check_token_ids,
    parse_body,
    with_engine_hint,
)
from kvtier.router.responses import FORWARD_ERRORS, AnswerRelay, ClientGone, error, unless_gone
from kvtier.router.tokenize import PromptTokenizer
from kvtier.router.upstream import UpstreamClients

log = logging.getLogger(__name__)

PASS_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


class Proxy:
    def __init__(
        self,
        core: RoutingCore,
        config: RouterConfig,
        metrics: RouterMetrics,
        upstream: UpstreamClients,
        tokenizer: PromptTokenizer | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        """``authenticator``: with credentials configured, every request must carry a token
        allowed to route (role client or admin); the token is not forwarded."""
        self.core = core
        self.authenticator = authenticator
        self.backends = core.backends
        self.config = config
        self.metrics = metrics
        self.upstream = upstream
        self.tokenizer = tokenizer
        self._parsing = asyncio.Semaphore(PARSE_SLOTS)  # large bodies parsed at once
        self._tokenizing: set[str] = set()  # sessions whose last turn is being tokenized
        self._background: set[asyncio.Task[None]] = set()  # referenced until done
        self.offload = PrefillOffload(config) if config.offload else None
        self.relay = AnswerRelay(core, metrics)  # the answer's way back (responses.py)

    # -- tokens ------------------------------------------------------------------------------

    async def prompt_ids(
        self, path: str, body: dict[str, Any], session: str | None
    ) -> tuple[list[int] | None, dict[str, Any], int | None]:
        """(token ids to route by, body to forward, the prompt's length in tokens) of a body
        ``parse_body`` checked. A chat turn that extends its session's last one is routed by
        that turn's ids and an estimated length, and tokenized after (``router.tokenize``,
        ``route_by_last_turn``)."""
        if path == CHAT_PATH:
            if self.tokenizer is not None:
                if session is not None and self.config.route_by_last_turn:
                    last = self.tokenizer.last_turn_ids(body, session)
                    if last is not None:
                        self._tokenize_later(body, session)
                        return last[0], body, last[1]
                ids = await asyncio.to_thread(self.tokenizer.chat_ids, body, session)
                return ids, body, len(ids)
            return _counted(await self._remote_ids({"messages": body["messages"]}, body), body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is not None:
                ids = await asyncio.to_thread(self.tokenizer.completion_ids, prompt)
                return ids, {**body, "prompt": ids}, len(ids)  # vLLM need not tokenize again
            return _counted(await self._remote_ids({"prompt": prompt}, body), body)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):  # token ids (checked by parse_body)
                return prompt, body, len(prompt)
            if isinstance(first, list):  # a batch: route by its first prompt
                return first, body, len(first)
            if isinstance(first, str) and self.tokenizer is not None:
                ids = await asyncio.to_thread(self.tokenizer.completion_ids, first)
                return ids, body, len(ids)
            return None, body, None
        raise BadRequest("prompt: a string, a list of token ids, or a list of those is required")

    def _tokenize_later(self, body: dict[str, Any], session: str) -> None:
        """Tokenize this turn off the request's path, for the session's next turn (one at a
        time per session: a turn arriving meanwhile routes by the older one)."""
        if session in self._tokenizing or self.tokenizer is None:
            return
        self._tokenizing.add(session)
        tokenizer = self.tokenizer

        async def tokenize() -> None:
            try:
                await asyncio.to_thread(tokenizer.chat_ids, body, session)
            except Exception as exc:  # routing by the older turn still works
                log.debug("tokenizing session %s after routing: %r", session, exc)
            finally:
                self._tokenizing.discard(session)

        task = asyncio.get_running_loop().create_task(tokenize())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _remote_ids(self, payload: dict[str, Any], body: dict[str, Any]) -> list[int] | None:
        """No local tokenizer: ask an instance's ``/tokenize`` (None if none answers)."""
        try:
            backend = self.backends.routable()[0]
            resp = await self.upstream.to(backend.url).post(
                f"{backend.url}/tokenize",
                json={"model": body.get("model"), **payload},
                timeout=self.config.connect_timeout_s + 5,
            )
            resp.raise_for_status()
            return check_token_ids(resp.json()["tokens"], "/tokenize")
        except (NoBackend, httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            log.debug("router: /tokenize failed: %s", exc)
            return None

    # -- forwarding --------------------------------------------------------------------------

    def refused(self, request: Request) -> Response | None:
        if self.authenticator is None or not self.authenticator.enabled:
            return None
        try:
            principal = self.authenticator.principal(
                bearer(request.headers.get("authorization")),
                certificate=peer_identities(request.scope),  # none unless mTLS verified one
            )
            principal.require(Permission.ROUTE, "send requests through the router")
        except KvtierError as exc:
            status = 401 if exc.code.value == "UNAUTHENTICATED" else 403
            self.metrics.rejected.labels(str(status)).inc()
            return error(status, exc.message, "authentication_error")
        return None

    async def handle(self, request: Request, path: str) -> Response:
        denied = self.refused(request)
        if denied is not None:
            return denied
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:  # (BodyLimit refuses it first, when served)
            self.metrics.rejected.labels("413").inc()
            return error(413, f"body over {self.config.max_body_bytes} bytes", "invalid_request")
        try:
            body = await self._parse(raw, path)
            session = request.headers.get(self.config.session_header) or body.get("user")
            ids, forward, counted = await self.prompt_ids(path, body, session)
        except (ValueError, TypeError, KeyError) as exc:  # BadRequest is a ValueError
            self.metrics.rejected.labels("400").inc()
            return error(400, f"bad request: {exc}", "invalid_request_error")
        except Exception as exc:  # a template the tokenizer cannot render, ...
            self.metrics.rejected.labels("400").inc()
            return error(400, f"cannot tokenize this request: {exc!r}", "invalid_request_error")
        prompt_tokens = counted if counted is not None else max(1, len(raw) // 4)
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS}
        headers.setdefault("content-type", "application/json")  # what is forwarded is JSON
        if self.authenticator is not None and self.authenticator.enabled:
            headers.pop("authorization", None)  # ours, not the instance's
        if forward is body:
            content = raw
        elif prompt_tokens * 8 > INLINE_BYTES:  # as large to encode as to parse
            content = await asyncio.to_thread(_encode, forward)
        else:
            content = _encode(forward)
        stream = bool(body.get("stream"))
        start = time.perf_counter()
        tried: set[str] = set()
        last: Response | None = None
        for attempt in range(self.config.retries + 1):
            try:
                routed = await asyncio.to_thread(
                    self.core.route, ids, prompt_tokens, session, frozenset(tried), dispatch=True
                )
            except NoBackend as exc:
                if last is not None:
                    return last
                status = 429 if exc.saturated else 503
                self.metrics.rejected.labels(str(status)).inc()
                kind = "rate_limit_exceeded" if exc.saturated else "service_unavailable"
                return error(status, str(exc), kind, retry_after=self.config.eject_s / 2)
            backend = routed.backend  # counted as its load by route (dispatch)
            try:
                self._count_decision(routed, attempt)
                offloaded = False
                if attempt == 0 and self.offload is not None and ids is not None:
                    offloaded = await self._maybe_offload(
                        routed, path, forward, headers, ids, tried
                    )
            except BaseException:  # cancelled (the client left) or failed: uncount it
                self.backends.finished(backend, prompt_tokens, got_first_token=False)
                raise
            session = self.upstream.forwarder(backend.url)
            # the index's answer for this decision goes with the request (no word after an
            # offloaded prefill: its chunks are on the helper's node, which the answer predates)
            worded = self.config.engine_hints and backend.reads_hint and not offloaded
            hint = routed.elsewhere_tokens if worded else None
            sent = with_engine_hint(content, forward, hint)
            try:
                # a non-streamed answer's headers come with its end: until then, the client
                # leaving must cancel the request (closing the upstream connection)
                upstream = await unless_gone(
                    request, session.post(f"{backend.url}{path}", data=sent, headers=headers)
                )
            except ClientGone:
                self.backends.finished(backend, prompt_tokens, got_first_token=False)
                self.core.log_decision(routed, {"outcome": "client went away"})
                return Response(status_code=499)
            except FORWARD_ERRORS as exc:
                self._failed(backend, routed, prompt_tokens, type(exc).__name__, tried)
                last = error(502, f"instance {backend.name} failed: {exc!r}", "upstream_error")
                continue
            if upstream.status >= 500:
                try:
                    text = await upstream.read()
                except FORWARD_ERRORS:
                    text = b""
                finally:
                    upstream.close()
                self._failed(backend, routed, prompt_tokens, f"http {upstream.status}", tried)
                last = Response(text, upstream.status, media_type="application/json")
                continue
            if stream and upstream.status == 200:
                return self.relay.stream(upstream, backend, routed, start)
            return await self.relay.whole(request, upstream, backend, routed, start)
        assert last is not None
        return last

    async def _maybe_offload(
        self,
        routed: Routed,
        path: str,
        forward: dict[str, Any],
        headers: dict[str, str],
        ids: list[int],
        tried: set[str],
    ) -> bool:
        """Prefill on a helper when the cost model says so (``offload.py``); whatever
        happens there, the request then goes to its own instance, which loads what arrived
        and computes the rest. True: a helper was asked to prefill."""
        assert self.offload is not None
        try:
            candidates = self.backends.routable(frozenset(tried))
        except NoBackend:
            return False
        choice = self.offload.choose(routed, candidates)
        if choice is None:
            return False
        if not self.offload.begin():
            self.metrics.offloads.labels("busy").inc()
            return False
        helper, tokens = choice.helper, routed.prompt_tokens
        outcome = "failed"
        self.backends.dispatched(helper, tokens)
        try:
            resp = await self.upstream.to(helper.url).post(
                f"{helper.url}{path}",
                content=_encode(prefill_only(forward)),
                headers=headers,
                timeout=self.config.offload_timeout_s,
            )
            if resp.status_code == 200:
                outcome = await self._settled(helper, ids)
        except httpx.HTTPError as exc:
            log.info("router: offloaded prefill on %s failed: %r", helper.name, exc)
        finally:
            # answered or not, its prefill is no longer pending there
            self.backends.finished(helper, tokens, got_first_token=False)
            self.offload.end()
        self.metrics.offloads.labels(outcome).inc()
        self.core.log_decision(
            routed,
            {
                "outcome": f"prefill offloaded: {outcome}",
                "helper": helper.name,
                "cost_here": round(choice.here_tokens),
                "cost_offload": round(choice.offload_tokens),
            },
        )
        return True

    async def _settled(self, helper: Backend, ids: list[int]) -> str:
        """Wait (``offload_settle_s`` at most) for the index to show the helper's chunks in
        its node's pool: saves commit a step or two after the prefill answered."""
        want = len(ids) // self.core.chunk_tokens(helper.namespace or b"")
        deadline = time.monotonic() + self.config.offload_settle_s
        while True:
            held = await asyncio.to_thread(self.core.node_run, helper, ids)
            if held >= want:
                return "ok"
            if time.monotonic() >= deadline:
                return "unsettled"
            await asyncio.sleep(0.01)

    async def _parse(self, raw: bytes, path: str) -> dict[str, Any]:
        """``parse_body``, on a worker thread for a large body (``requests.py`` says why)."""
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw, path)
        async with self._parsing:
            return await asyncio.to_thread(parse_body, raw, path)

    def _count_decision(self, routed: Routed, attempt: int) -> None:
        self.metrics.decision.observe(routed.seconds)
        self.metrics.decisions.labels(self.core.policy.name, routed.decision.reason).inc()
        if attempt == 0:
            self.metrics.prompt_tokens.inc(routed.prompt_tokens)
            self.metrics.predicted_cached.inc(routed.predicted_cached)

    def _failed(
        self, backend: Backend, routed: Routed, prompt_tokens: int, reason: str, tried: set[str]
    ) -> None:
        """Before the first byte: out of rotation, and the request goes elsewhere."""
        self.backends.finished(backend, prompt_tokens, got_first_token=False)
        if self.backends.eject(backend, reason):
            self.metrics.ejections.labels("request").inc()
        self.metrics.retries.labels(reason.split(" ")[0]).inc()
        tried.add(backend.name)
        self.core.log_decision(routed, {"outcome": "retried", "error": reason})

    async def models(self) -> Response:
        try:
            backend = self.backends.routable()[0]
            resp = await self.upstream.to(backend.url).get(f"{backend.url}/v1/models")
        except (NoBackend, httpx.HTTPError) as exc:
            return error(503, f"no instance answers: {exc}", "service_unavailable", 5)
        return Response(resp.content, resp.status_code, media_type="application/json")


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _counted(
    ids: list[int] | None, body: dict[str, Any]
) -> tuple[list[int] | None, dict[str, Any], int | None]:
    return ids, body, (len(ids) if ids is not None else None)
