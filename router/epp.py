"""``kvtier router epp``: the Gateway API Inference Extension's endpoint picker (EPP) over the
router's scoring core. Kubernetes gateways (Envoy-based: Istio, Envoy Gateway, kgateway, GKE)
send each request of an ``InferencePool`` through it as an Envoy ext_proc gRPC stream; it
answers which pod serves the request, and the gateway forwards it there. The decision is the
one ``kvtier router serve`` makes (``RoutingCore``: one index query, the policy), and the
request is tokenized as the HTTP proxy does (``Proxy.prompt_ids``: in process with
``router.model``, else an instance's ``/tokenize``).

The protocol (the extension's proposal 004-endpoint-picker-protocol, docs/router.md):

- one ``Process`` stream per HTTP request: ``request_headers``, ``request_body`` chunks,
  then (if the gateway sends them) ``response_headers``/``response_body``/trailers;
- ``FULL_DUPLEX_STREAMED`` bodies (what the extension's gateways configure): nothing is
  answered until the body is whole; then a ``request_headers`` response carrying the header
  mutation, followed by the body streamed back (``streamed_response``, 62 kB chunks);
  ``BUFFERED``: the headers are answered at once (CONTINUE) and the mutation rides on the
  ``request_body`` response. The mode comes from the stream's ``protocol_config`` when Envoy
  sends it, else ``router.epp_body_mode``;
- the pick: header ``x-gateway-destination-endpoint: <ip:port>`` (plus ``router.epp_fallbacks``
  more, comma-separated) and the same value in dynamic metadata
  ``envoy.lb/x-gateway-destination-endpoint``, with ``clear_route_cache``;
- ``envoy.lb.subset_hint/x-gateway-destination-endpoint-subset`` in the request's filter
  metadata: only those ``ip:port``s may be picked (none of them eligible, or empty: 503);
- nothing to pick: ``ImmediateResponse`` 503 (none healthy) or 429 (all at
  ``max_in_flight``); a body that is not JSON, or a prompt the proxy would refuse: 400; over
  ``max_body_bytes``: 413; with credentials configured, a request without a token allowed to
  route: 401/403 (the token is checked from the request's ``Authorization`` header, as the
  proxy does, and removed before the request goes upstream; a request without one is judged
  by the stream's verified client certificate, the gateway's, as any gRPC caller is);
- ``envoy.lb/x-gateway-destination-endpoint-served`` in a response's metadata: the gateway
  fell back to another endpoint; the load accounting moves there. A 5xx response status
  ejects the instance that answered it, as in the proxy.

Load accounting: a pick counts as dispatched until its stream ends (or its response body
ends); the first response body chunk counts as the first token. The process around this
servicer (gRPC server, health, background loops): ``kvtier.router.epp_service``.

Threading: one asyncio loop (grpc.aio) serves every stream; routing and tokenizing run in
worker threads (``asyncio.to_thread``), as in the proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from kvtier.core.auth import Authenticator, Permission, bearer
from kvtier.core.config.router import RouterConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.rpc import certificate_identities
from kvtier.router.backends import NoBackend
from kvtier.router.core import Routed, RoutingCore
from kvtier.router.epp_wire import (
    DESTINATION,
    LB_NAMESPACE,
    Refused,
    _api,
    _body_responses,
    _Exchange,
    _header_value,
    _is_ip,
    _served,
    _set_header,
    _subset,
    endpoint_of,
    immediate,
)
from kvtier.router.metrics import RouterMetrics
from kvtier.router.proxy import Proxy
from kvtier.router.requests import parse_body

log = logging.getLogger(__name__)


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer: one ``Process`` stream per HTTP request."""

    def __init__(
        self,
        core: RoutingCore,
        config: RouterConfig,
        metrics: RouterMetrics,
        prompts: Proxy,
        authenticator: Authenticator | None = None,
        on_route: Any = None,
    ) -> None:
        """``prompts``: the HTTP proxy, used for its tokenization only (``prompt_ids``);
        ``on_route``: called with whether the last decision found an instance (health)."""
        self.core = core
        self.backends = core.backends
        self.config = config
        self.metrics = metrics
        self.prompts = prompts
        self.authenticator = authenticator
        self.on_route = on_route
        self._warned: set[str] = set()

    async def Process(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        duplex = self.config.epp_body_mode == "full-duplex"
        ex = _Exchange(duplex_request=duplex, duplex_response=duplex)
        ex.certificate = tuple(certificate_identities(context))  # the gateway's, if mTLS
        try:
            async for request in request_iterator:
                if request.HasField("protocol_config"):
                    ex.configure(request.protocol_config)
                if request.HasField("metadata_context"):
                    subset = _subset(request.metadata_context)
                    if subset is not None:
                        ex.subset = subset
                    self._follow_served(ex, request.metadata_context)
                try:
                    answers = await self._handle(ex, request)
                except Refused as exc:
                    self.metrics.rejected.labels(str(exc.status)).inc()
                    ex.outcome = f"refused {exc.status}"
                    yield immediate(exc.status, exc.message, exc.kind, exc.retry_after)
                    return  # the gateway answers the client; nothing more on this stream
                if request.observability_mode:
                    continue  # the gateway expects no answers (it cannot be routed either)
                for answer in answers:
                    yield answer
        finally:
            self._release(ex)

    # -- messages ----------------------------------------------------------------------------

    async def _handle(self, ex: _Exchange, request: Any) -> list[Any]:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(ex, request.request_headers)
        if kind == "request_body":
            return await self._request_body(ex, request.request_body)
        if kind == "request_trailers":
            answers: list[Any] = []
            if ex.routed is None and ex.duplex_request:  # the body ended with the trailers
                answers = await self._pick(ex, bytes(ex.body), end_of_stream=False)
            return [*answers, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return [self._response_headers(ex, request.response_headers)]
        if kind == "response_body":
            return self._response_body(ex, request.response_body)
        if kind == "response_trailers":
            self._finish(ex, "ok")
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _request_headers(self, ex: _Exchange, msg: Any) -> list[Any]:
        ex.headers = {h.key.lower(): _header_value(h) for h in msg.headers.headers}
        self._authorize(ex.headers, ex.certificate)
        if msg.end_of_stream or not ex.body_expected:  # no body to route by (a GET, ...)
            return await self._pick(ex, None)
        if ex.duplex_request:
            return []  # answered with the pick, once the body is whole
        common = pb.CommonResponse(header_mutation=self._strip())
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))]

    async def _request_body(self, ex: _Exchange, msg: Any) -> list[Any]:
        if ex.routed is not None:  # picked already (mode NONE said no body, yet one came)
            return (
                _body_responses(bytes(msg.body), True, msg.end_of_stream)
                if ex.duplex_request
                else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
            )
        ex.body += msg.body
        if len(ex.body) > self.config.max_body_bytes:
            raise Refused(413, f"body over {self.config.max_body_bytes} bytes", "invalid_request")
        if msg.end_of_stream:
            return await self._pick(ex, bytes(ex.body))
        if ex.duplex_request:
            return []
        return [pb.ProcessingResponse(request_body=pb.BodyResponse())]  # STREAMED: go on

    def _response_headers(self, ex: _Exchange, msg: Any) -> Any:
        status = next((_header_value(h) for h in msg.headers.headers if h.key == ":status"), "")
        failed = ex.backend is not None and status.isdigit() and int(status) >= 500
        if failed and ex.backend is not None and self.backends.eject(ex.backend, f"http {status}"):
            self.metrics.ejections.labels("request").inc()
        if msg.end_of_stream:
            self._finish(ex, "ok")
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def _response_body(self, ex: _Exchange, msg: Any) -> list[Any]:
        if not ex.got_first and ex.backend is not None:
            ex.got_first = True
            self.backends.first_token(ex.backend, ex.prompt_tokens)
        if msg.end_of_stream:
            self._finish(ex, "ok")
        if ex.duplex_response:
            return _body_responses(bytes(msg.body), False, msg.end_of_stream)
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    # -- the pick ----------------------------------------------------------------------------

    async def _pick(
        self, ex: _Exchange, raw: bytes | None, end_of_stream: bool = True
    ) -> list[Any]:
        ids, forward, session, counted = await self._prompt(ex, raw)
        prompt_tokens = counted if counted is not None else max(1, len(raw or b"") // 4)
        subset = None
        if ex.subset is not None:  # ip:port as the gateway writes it, or an instance's name
            known = {b.name for b in self.backends.all() if endpoint_of(b.url) in ex.subset}
            subset = ex.subset | known
        try:
            routed = await asyncio.to_thread(
                self.core.route, ids, prompt_tokens, session, frozenset(), subset, dispatch=True
            )
        except NoBackend as exc:
            if self.on_route is not None:
                self.on_route(exc.saturated)
            status = 429 if exc.saturated else 503
            kind = "rate_limit_exceeded" if exc.saturated else "service_unavailable"
            raise Refused(status, str(exc), kind, retry_after=self.config.eject_s / 2) from exc
        if self.on_route is not None:
            self.on_route(True)
        self.metrics.decision.observe(routed.seconds)
        self.metrics.decisions.labels(self.core.policy.name, routed.decision.reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.predicted_cached.inc(routed.predicted_cached)
        # counted as the chosen instance's load by route (dispatch)
        ex.routed, ex.backend, ex.prompt_tokens = routed, routed.backend, prompt_tokens

        value = ",".join(self._endpoints(routed))
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: value}})
        mutation = self._strip()
        mutation.set_headers.append(_set_header(DESTINATION, value))
        body = raw if forward is None else forward
        if raw is None:  # picked on the headers
            common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
        if ex.duplex_request:
            # the body goes back through us: its length is ours to state (Envoy drops it)
            mutation.set_headers.append(_set_header("content-length", str(len(body or b""))))
            common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            head = pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
            return [head, *_body_responses(body or b"", True, end_of_stream)]
        # BUFFERED: the headers went on already; the mutation rides on the body's answer
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        if forward is not None:
            mutation.set_headers.append(_set_header("content-length", str(len(forward))))
            common.body_mutation.body = forward
        return [
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
            )
        ]

    async def _prompt(
        self, ex: _Exchange, raw: bytes | None
    ) -> tuple[list[int] | None, bytes | None, str | None, int | None]:
        """(token ids, body to forward if changed, session, the prompt's length in tokens), as
        the proxy reads a request."""
        session: str | None = ex.headers.get(self.config.session_header.lower()) or None
        if raw is None:
            return None, None, session, None
        api = _api(ex.headers.get(":path", ""))
        if api is None and "json" not in ex.headers.get("content-type", ""):
            return None, None, session, None  # not an API we tokenize: route by load
        try:
            if api is None:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            else:  # the proxy's checks (requests.py): 400 for what it would refuse
                body = parse_body(raw, api)
            user = body.get("user")
            session = session or (user if isinstance(user, str) and user else None)
            if api is None:
                return None, None, session, None
            ids, forward, counted = await self.prompts.prompt_ids(api, body, session)
        except (ValueError, TypeError, KeyError) as exc:
            raise Refused(400, f"bad request: {exc}", "invalid_request_error") from exc
        except Exception as exc:  # a template the tokenizer cannot render, ...
            raise Refused(
                400, f"cannot tokenize this request: {exc!r}", "invalid_request_error"
            ) from exc
        encoded = json.dumps(forward).encode() if forward is not body else None
        return ids, encoded, session, counted

    def _endpoints(self, routed: Routed) -> list[str]:
        chosen = endpoint_of(routed.backend.url)
        out = [chosen]
        if self.config.epp_fallbacks:
            scores = routed.decision.scores
            order = sorted(
                (i for i in range(len(routed.candidates)) if i != routed.decision.index),
                key=lambda i: (scores[i] if len(scores) == len(routed.candidates) else 0.0, i),
            )
            urls = {b.name: b.url for b in self.backends.all()}
            for i in order[: self.config.epp_fallbacks]:
                url = urls.get(routed.candidates[i].name)
                if url is not None:
                    out.append(endpoint_of(url))
        if not _is_ip(chosen) and chosen not in self._warned:
            self._warned.add(chosen)
            log.warning(
                "router epp: %s is not an ip:port; gateways dial the pod IP the InferencePool "
                "selects (announce instance_api as http://<pod IP>:<port>)",
                chosen,
            )
        return out

    # -- credentials, accounting --------------------------------------------------------------

    def _authorize(self, headers: dict[str, str], certificate: tuple[str, ...]) -> None:
        """``certificate``: the identities of the stream's verified client certificate, i.e.
        the gateway's (the EPP never sees the end client's TLS): without a token in the
        request, the gateway's credential decides, as for any gRPC caller."""
        if self.authenticator is None or not self.authenticator.enabled:
            return
        try:
            principal = self.authenticator.principal(
                bearer(headers.get("authorization")), certificate=certificate
            )
            principal.require(Permission.ROUTE, "send requests through the router")
        except KvtierError as exc:
            status = 401 if exc.code is ErrorCode.UNAUTHENTICATED else 403
            raise Refused(status, exc.message, "authentication_error") from exc

    def _strip(self) -> Any:
        """The request's own token is ours, not the instance's: it does not go upstream."""
        if self.authenticator is not None and self.authenticator.enabled:
            return pb.HeaderMutation(remove_headers=["authorization"])
        return pb.HeaderMutation()

    def _follow_served(self, ex: _Exchange, metadata: Any) -> None:
        """The gateway went down our list: account the request to the one that served it."""
        served = _served(metadata)
        if served is None or ex.backend is None or ex.released:
            return
        if endpoint_of(ex.backend.url) == served:
            return
        other = next((b for b in self.backends.all() if endpoint_of(b.url) == served), None)
        if other is None:
            return
        self.backends.finished(ex.backend, ex.prompt_tokens, ex.got_first)
        self.backends.dispatched(other, ex.prompt_tokens)
        ex.backend = other

    def _finish(self, ex: _Exchange, outcome: str) -> None:
        ex.outcome = outcome
        self._release(ex)

    def _release(self, ex: _Exchange) -> None:
        if ex.released or ex.backend is None or ex.routed is None:
            return
        ex.released = True
        self.backends.finished(ex.backend, ex.prompt_tokens, ex.got_first)
        self.core.log_decision(
            ex.routed,
            {"outcome": ex.outcome, "front": "epp", "endpoint": endpoint_of(ex.backend.url)},
        )
