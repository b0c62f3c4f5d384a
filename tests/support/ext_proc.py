"""Envoy's side of the endpoint picker's ext_proc stream: request headers and metadata as the
gateway sends them, one HTTP request's ``Process`` stream, and the pick read back."""

from __future__ import annotations

import queue
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

from kvtier.router.epp import DESTINATION

BODY = {"model": "stub", "prompt": "hello there", "max_tokens": 3}


def http_headers(
    path: str = "/v1/completions",
    method: str = "POST",
    eos: bool = False,
    extra: dict[str, str] | None = None,
) -> Any:
    values = {":path": path, ":method": method, ":authority": "gateway", **(extra or {})}
    if method == "POST":
        values.setdefault("content-type", "application/json")
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers), end_of_stream=eos)


def metadata(namespace: str, values: dict[str, Any]) -> Any:
    struct = struct_pb2.Struct()
    struct.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: struct})


def subset_hint(endpoints: list[str] | str) -> Any:
    return metadata("envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": endpoints})


class Envoy:
    """One HTTP request's ``Process`` stream, driven as Envoy's ext_proc filter drives it."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(channel)
        self._responses = stub.Process(iter(self._requests.get, None), timeout=60)
        self.closed = False

    def send(self, **fields: Any) -> None:
        self._requests.put(pb.ProcessingRequest(**fields))

    def recv(self) -> Any:
        return next(self._responses)

    def close(self) -> list[Any]:
        """Half-close (the HTTP request is over); the rest of the EPP's answers."""
        if self.closed:
            return []
        self.closed = True
        self._requests.put(None)
        return list(self._responses)


def destination(response: Any) -> tuple[str, str]:
    """(header value, ``envoy.lb`` metadata value) of a response carrying the pick."""
    common = getattr(response, response.WhichOneof("response")).response
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    meta = json_format.MessageToDict(response.dynamic_metadata)
    assert common.clear_route_cache
    return headers[DESTINATION], meta["envoy.lb"][DESTINATION]


def set_headers(response: Any) -> dict[str, str]:
    common = getattr(response, response.WhichOneof("response")).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
