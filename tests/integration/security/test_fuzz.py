"""Fuzz the wire decoders of the store and the index as an authenticated but hostile client
would: every RPC gets messages whose fields hold anything their types allow (wrong key
lengths, negative and huge sizes, NaN deadlines, junk JSON, random bytes). Each call must end
in a clear status, never INTERNAL (a handler bug), and the service must keep serving."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.rpc import ClientAuth, open_channel
from kvtier.index.proto import index_pb2
from kvtier.store.proto import store_pb2
from kvtier.testing.services import Service, _start

from support.secure_env import TOKENS, SecureStore, auth_env

F = FieldDescriptor
KEYISH = st.one_of(
    st.binary(max_size=64),
    st.integers(0, 8).map(lambda n: bytes(16 * n)),  # well-formed packed keys, all zero
)
SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_BYTES: KEYISH,
    F.TYPE_STRING: st.one_of(
        st.text(max_size=40), st.just('{"model": 1}'), st.just("{}"), st.just("\x00")
    ),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    F.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1),
    F.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    F.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
}


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Field values for ``descriptor``: any subset of its fields, each any value of its type."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if _is_map(field):
            key, val = field.message_type.fields
            fields[field.name] = st.dictionaries(
                SCALARS[key.type], SCALARS.get(val.type, st.none()), max_size=4
            )
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth >= 2:
                continue
            value: st.SearchStrategy[Any] = messages(field.message_type, depth + 1)
        elif field.type == F.TYPE_ENUM:
            value = st.sampled_from([v.number for v in field.enum_type.values])
        else:
            value = SCALARS[field.type]
        if field.is_repeated:
            value = st.lists(value, max_size=6)
        fields[field.name] = value
    return st.fixed_dictionaries({}, optional=fields)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _tame(values: dict[str, Any]) -> dict[str, Any]:
    """Long-polls and deadlines are bounded so the fuzzer does not wait on them."""
    for name in ("timeout_s",):
        if name in values and (math.isnan(values[name]) or values[name] > 0.05):
            values[name] = 0.05
    return values


def _build(message_type: Any, values: dict[str, Any]) -> Any:
    message = message_type()
    for name, value in values.items():
        field = message_type.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            getattr(message, name).update(value)
        elif field.type == F.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            for item in items:
                sub = getattr(message, name).add() if field.is_repeated else getattr(message, name)
                sub.CopyFrom(_build(type(sub), item))
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def _fuzz_method(
    call: Any,
    request_type: Any,
    descriptor: Descriptor,
    name: str,
    examples: int,
    seen: dict[str, int],
) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(messages(descriptor))
    def one(values: dict[str, Any]) -> None:
        request = _build(request_type, _tame(values))
        try:
            call(request, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            details = exc.details()  # type: ignore[attr-defined]
            assert code is not grpc.StatusCode.INTERNAL, (name, request, details)
            assert code is not grpc.StatusCode.UNKNOWN, (name, request, details)
        seen[code.name] = seen.get(code.name, 0) + 1

    one()


def fuzz_service(address: str, pb: Any, service: str, examples: int) -> dict[str, int]:
    channel = open_channel(address, ClientAuth(TOKENS["admin"]))
    methods = pb.DESCRIPTOR.services_by_name[service].methods_by_name
    seen: dict[str, int] = {}
    try:
        for name, method in methods.items():
            request_type = getattr(pb, method.input_type.name)
            reply_type = getattr(pb, method.output_type.name)
            call = channel.unary_unary(
                f"/{pb.DESCRIPTOR.package}.{service}/{name}",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=reply_type.FromString,
            )

            _fuzz_method(call, request_type, method.input_type, name, examples, seen)
    finally:
        channel.close()
    return seen


def test_store_decoders_survive_hostile_messages(secure_store: SecureStore) -> None:
    seen = fuzz_service(secure_store.address, store_pb2, "Store", examples=60)
    assert seen.get("INVALID_ARGUMENT", 0) > 0 and seen.get("OK", 0) > 0  # both paths taken
    info = open_channel(secure_store.address, ClientAuth(TOKENS["admin"]))
    stub_info = info.unary_unary(
        "/kvtier.store.v1.Store/Info",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=store_pb2.InfoReply.FromString,
    )
    assert stub_info(store_pb2.InfoRequest(), timeout=5).node_id == "secure-node"
    info.close()


@pytest.fixture(scope="module")
def index_service() -> Iterator[Service]:
    index = _start(["index", "serve", "--grpc-port", "0", "--http-port", "0"], auth_env())
    try:
        yield index
    finally:
        index.stop()


def test_index_decoders_survive_hostile_messages(index_service: Service) -> None:
    seen = fuzz_service(index_service.address, index_pb2, "Index", examples=40)
    assert seen.get("INVALID_ARGUMENT", 0) > 0
    assert index_service.proc.poll() is None
