"""The ext_proc side of ``kvtier router epp``: the names the Gateway API Inference Extension's
protocol uses (headers, metadata namespaces, health services) and the messages it exchanges
(immediate responses, header mutations, streamed bodies), apart from the decisions
``router/epp.py`` makes with them."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from grpc_health.v1 import health_pb2

from kvtier.router.backends import Backend
from kvtier.router.core import Routed

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
BODY_CHUNK = 62_000  # bytes per streamed body chunk (some Envoy builds cap a chunk at 64 kB)
READY_SERVICES = (
    "",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "inference-extension",
)
LIVENESS = "liveness"
HEALTH_S = 0.5  # how often health follows the instances' state

_Mode = processing_mode_pb2.ProcessingMode
_SET = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Refused(Exception):
    """The request gets an ImmediateResponse with this status instead of an endpoint."""

    def __init__(
        self, status: int, message: str, kind: str, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after


def endpoint_of(url: str) -> str:
    """``ip:port`` of an instance's base URL (what the gateway dials)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _api(path: str) -> str | None:
    """Which OpenAI generation API a request path is (the proxy's two), if any."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return "/v1/chat/completions"
    if path.endswith("/completions"):
        return "/v1/completions"
    return None


def _header_value(header: Any) -> str:
    raw: bytes = header.raw_value
    return raw.decode("utf-8", "replace") if raw else str(header.value)


def _set_header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_SET
    )


def immediate(
    status: int, message: str, kind: str, retry_after: float | None = None
) -> pb.ProcessingResponse:
    """An answer the gateway sends the client itself (the proxy's JSON error body)."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    headers = [_set_header("content-type", "application/json")]
    if retry_after:
        headers.append(_set_header("retry-after", str(max(1, round(retry_after)))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body.encode(),
            details=f"kvtier_epp_{kind}",
        )
    )


def _subset(metadata: Any) -> set[str] | None:
    """The subset hint's ``ip:port``s (a list, or a comma-separated string); None: no hint."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    hint = metadata.filter_metadata[SUBSET_NAMESPACE]
    if SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return {i.strip() for i in items if i.strip()}


def _served(metadata: Any) -> str | None:
    if LB_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[LB_NAMESPACE].fields
    if SERVED not in fields:
        return None
    value: str = fields[SERVED].string_value
    return value.split(",")[0].strip() or None


def _body_responses(body: bytes, request: bool, end_of_stream: bool = True) -> list[Any]:
    """``body`` streamed back in FULL_DUPLEX_STREAMED mode, in chunks Envoy accepts."""
    chunks = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        streamed = pb.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1
        )
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        answer = pb.BodyResponse(response=common)
        out.append(
            pb.ProcessingResponse(request_body=answer)
            if request
            else pb.ProcessingResponse(response_body=answer)
        )
    return out


@dataclass
class _Exchange:
    """One HTTP request's ext_proc stream."""

    duplex_request: bool  # FULL_DUPLEX_STREAMED request body: answer after the whole body
    duplex_response: bool
    body_expected: bool = True  # False: request_body_mode NONE, pick on the headers
    headers: dict[str, str] = field(default_factory=dict)
    certificate: tuple[str, ...] = ()  # the gateway's verified certificate's identities
    subset: set[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    routed: Routed | None = None
    backend: Backend | None = None
    prompt_tokens: int = 0
    got_first: bool = False
    outcome: str = "stream closed"
    released: bool = False

    def configure(self, config: Any) -> None:
        """Envoy's own statement of its processing modes (first message of the stream)."""
        self.duplex_request = config.request_body_mode == _Mode.FULL_DUPLEX_STREAMED
        self.body_expected = config.request_body_mode != _Mode.NONE
        self.duplex_response = config.response_body_mode == _Mode.FULL_DUPLEX_STREAMED
