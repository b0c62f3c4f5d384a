"""gRPC plumbing every kvtier service and client shares: errors on the wire, handlers,
channels, servers. Services add only their messages and methods.

Errors: a handler that raises ``KvtierError`` answers with a gRPC status *and* the kvtier code
in trailing metadata (``kvtier-error-code``); ``error_from_rpc`` turns that back into the same
``KvtierError`` on the client, so a caller sees one exception type whether the service is in
process or across a socket. A server that cannot be reached is UNAVAILABLE.

Threading: stubs and channels are thread-safe; handlers run on the server's thread pool.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

import grpc

from kvtier.core.auth import (
    ANONYMOUS,
    UNAUTHENTICATED,
    Authenticator,
    Permission,
    Principal,
    bearer,
)
from kvtier.core.config.auth import AuthConfig, TlsConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.logs import Throttled

log = logging.getLogger(__name__)

ERROR_METADATA_KEY = "kvtier-error-code"
MESSAGE_LIMIT = 64 << 20  # bytes of one gRPC message (a batch of packed keys, a snapshot)

GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_NAMESPACE: grpc.StatusCode.NOT_FOUND,
    ErrorCode.NAMESPACE_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.WRONG_SIZE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_LEASE: grpc.StatusCode.NOT_FOUND,
    ErrorCode.LEASE_EXPIRED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNKNOWN_KEY: grpc.StatusCode.NOT_FOUND,
    ErrorCode.POOL_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.LIMIT_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.STALE_EPOCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNKNOWN_LOCATION: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    return GRPC_STATUS.get(code, grpc.StatusCode.FAILED_PRECONDITION)


def error_from_rpc(exc: grpc.RpcError, what: str) -> KvtierError:
    """The ``KvtierError`` the server raised, or UNAVAILABLE when ``what`` (e.g. "store
    127.0.0.1:50551") could not be reached in time."""
    call: Any = exc  # grpc.RpcError raised by a call is also a grpc.Call
    for key, value in call.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            try:
                return KvtierError(ErrorCode(value), call.details() or "")
            except ValueError:
                break
    status = call.code()
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return KvtierError(ErrorCode.UNAVAILABLE, f"{what} unreachable: {call.details()}")
    return KvtierError(ErrorCode.INTERNAL, f"{status.name}: {call.details()}")


def abort(context: grpc.ServicerContext, exc: KvtierError) -> NoReturn:
    """End the call with ``exc``'s status and kvtier code (raises: the handler stops)."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, exc.code.value),))
    context.abort(grpc_status(exc.code), exc.message)
    raise AssertionError("grpc's abort returned")  # it raises; this tells type checkers


S = TypeVar("S")


def handler(
    method: Callable[[S, Any, grpc.ServicerContext], Any],
) -> Callable[[S, Any, grpc.ServicerContext], Any]:
    """Wrap a servicer method: ``KvtierError`` and malformed input become a gRPC status with
    the kvtier code; a bug becomes INTERNAL (logged) and the server keeps serving. A servicer
    may define ``check(request)`` to refuse requests before the method runs (a store refuses
    a client attached to a previous epoch)."""

    @functools.wraps(method)
    def wrapper(self: S, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            check = getattr(self, "check", None)
            if check is not None:
                check(request)
            return method(self, request, context)
        except KvtierError as exc:
            abort(context, exc)
        except (ValueError, TypeError) as exc:  # malformed fields (bad key length, ...)
            abort(context, KvtierError(ErrorCode.INVALID_ARGUMENT, str(exc)))
        except Exception as exc:  # a bug: keep the server up
            log.exception("internal error in %s", getattr(method, "__name__", "handler"))
            abort(context, KvtierError(ErrorCode.INTERNAL, repr(exc)))

    return wrapper


def channel_options(max_message_bytes: int = MESSAGE_LIMIT) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_http_proxy", 0),
        # a channel of its own: a new client of a restarted server connects at once instead
        # of inheriting a shared subchannel's reconnect backoff (up to 120 s)
        ("grpc.use_local_subchannel_pool", 1),
        # and a channel that saw its server die (a store restart: session heartbeats keep it
        # busy) retries within a second, not after gRPC's default backoff of up to 120 s.
        # Not grpc.min_reconnect_backoff_ms: gRPC also takes it as the least time a connection
        # attempt is given, and at 100 ms a client of a busy (not dead) server failed with
        # "connection attempt timed out before receiving SETTINGS frame"; unset, an attempt
        # gets gRPC's 20 s, and the caller's own deadline still bounds the call.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


# -- credentials: client side ----------------------------------------------------------------


@dataclass(frozen=True)
class ClientAuth:
    """What a client presents: a bearer token and/or TLS settings (``auth.token``,
    ``auth.tls``). ``None`` where a client takes one means: nothing (loopback, no auth)."""

    token: str | None = None
    tls: TlsConfig | None = None

    @classmethod
    def from_config(cls, config: AuthConfig) -> ClientAuth:
        return cls(config.client_token(), config.tls if config.tls.enabled else None)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class _BearerToken(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return continuation(
            _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


def open_channel(
    address: str, auth: ClientAuth | None = None, max_message_bytes: int = MESSAGE_LIMIT
) -> grpc.Channel:
    """A channel to a kvtier service at ``host:port`` or ``unix:/path``, presenting ``auth``."""
    options = channel_options(max_message_bytes)
    tls = auth.tls if auth is not None and not address.startswith("unix:") else None
    if tls is not None:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca_file),
            private_key=_read(tls.key_file),
            certificate_chain=_read(tls.cert_file),
        )
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if auth is not None and auth.token:
        channel = grpc.intercept_channel(channel, _BearerToken(auth.token))
    return channel


# -- credentials: server side ----------------------------------------------------------------

_CALLER: ContextVar[Principal] = ContextVar("kvtier_caller", default=ANONYMOUS)


def caller() -> Principal:
    """The principal of the call this handler thread is serving (``ANONYMOUS`` in process)."""
    return _CALLER.get()


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Serve calls on this thread as ``principal`` (what ``caller()`` answers inside): for a
    server of the same methods beside gRPC (the store's control socket)."""
    token = _CALLER.set(principal)
    try:
        yield
    finally:
        _CALLER.reset(token)


# what a malformed request logs: one line per method and error type a minute, no traceback
# (the bytes are the caller's doing, not a bug here; a traceback each would be a log flood)
_malformed_log = Throttled(log)


class AuthInterceptor(grpc.ServerInterceptor):
    """Judges every call before a byte of its request body is read, then decodes the body
    and runs the handler, which finds the caller in ``caller()``. ``authenticator`` None: no
    judging (every caller is ``ANONYMOUS``), only the decoding. A method missing from
    ``permissions`` is refused: a new RPC is closed until someone decides who may call it.

    Why the handler it returns is client-streaming: gRPC reads and decodes a unary call's
    request before any handler or interceptor sees the call's peer, so an anonymous 60 MiB
    request used to be received and parsed (hundreds of MiB of Python objects) only to be
    refused. On the wire a unary call and a one-message client stream are the same; as a
    stream, the body is pulled (``next(requests)``) only once the caller is admitted, as raw
    bytes, and decoded here: malformed bytes answer INVALID_ARGUMENT with a throttled line
    in the log, instead of INTERNAL and a traceback per call."""

    def __init__(self, authenticator: Authenticator | None, permissions: Mapping[str, Permission]):
        self._auth = authenticator
        self._permissions = permissions

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler  # kvtier's services are unary; anything else is not ours
        method = details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        deserialize = handler.request_deserializer

        def judged(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            principal = self._judge(method, context)
            request = _decode(method, requests, deserialize, context)
            token = _CALLER.set(principal)
            try:
                return inner(request, context)
            finally:
                _CALLER.reset(token)

        return grpc.stream_unary_rpc_method_handler(
            judged, request_deserializer=None, response_serializer=handler.response_serializer
        )

    def _judge(self, method: str, context: grpc.ServicerContext) -> Principal:
        """The caller of ``method``, or the call aborted (UNAUTHENTICATED/PERMISSION_DENIED)."""
        if self._auth is None:
            return ANONYMOUS
        permission = self._permissions.get(method)
        if permission is Permission.PUBLIC:
            return UNAUTHENTICATED  # a PUBLIC method's caller, whoever it is
        try:
            metadata = dict(context.invocation_metadata())
            principal = self._auth.principal(
                bearer(metadata.get("authorization")),
                local=context.peer().startswith("unix:"),
                certificate=certificate_identities(context),
            )
            if permission is None:
                raise KvtierError(ErrorCode.PERMISSION_DENIED, f"{method}: not allowed")
            principal.require(permission, f"call {method}")
        except KvtierError as exc:
            abort(context, exc)
        return principal


def certificate_identities(context: grpc.ServicerContext) -> list[str]:
    """The identities of the client certificate this call's TLS handshake verified (against
    ``auth.tls.ca_file``; a server with a CA file requires one): its common name and its DNS
    and URI subject alternative names. Empty for a plaintext or Unix-socket call."""
    auth_context = context.auth_context() or {}
    if auth_context.get("transport_security_type") != [b"ssl"]:
        return []
    names: list[str] = []
    for key in ("x509_common_name", "peer_dns", "peer_uri"):
        names += [v.decode("utf-8", "replace") for v in auth_context.get(key, ())]
    return names


def _decode(
    method: str,
    requests: Iterator[bytes],
    deserialize: Callable[[bytes], Any] | None,
    context: grpc.ServicerContext,
) -> Any:
    """The one request message of a unary call, decoded; malformed: INVALID_ARGUMENT."""
    raw = next(requests, None)
    if raw is None:
        abort(context, KvtierError(ErrorCode.INVALID_ARGUMENT, f"{method}: no request"))
    if deserialize is None:
        return raw
    try:
        return deserialize(raw)
    except Exception as exc:  # a protobuf DecodeError: whatever the bytes were, not a bug
        cause = type(exc).__name__
        _malformed_log.warning(
            (method, cause), "malformed %s request from %s: %s", method, context.peer(), cause
        )
        abort(context, KvtierError(ErrorCode.INVALID_ARGUMENT, f"{method}: malformed request"))


def prepare_socket_dir(path: Path) -> None:
    """The directory of a Unix socket: created 0700; refused if another uid owns it or others
    may write it (they could swap the socket). The socket itself is made 0600 once bound."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, f"{directory}: not a directory owned by uid {os.getuid()}"
        )
    if st.st_mode & 0o077:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"{directory}: mode {stat.S_IMODE(st.st_mode):o}; a socket directory must be 0700",
        )
    if path.is_symlink() or path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"{path} exists and is not a socket")
        path.unlink()  # a previous store's; we hold the node lock, so it is not live


Register = Callable[[Any, grpc.Server], None]


@dataclass(frozen=True)
class ServerSecurity:
    """How a server authenticates: the authenticator, each method's permission, TLS."""

    authenticator: Authenticator
    permissions: Mapping[str, Permission]
    tls: TlsConfig | None = None
    # this service's own token: what it proves holding to a caller about to dial it (``Prove``)
    own_token: str | None = None


def start_server(
    services: Sequence[tuple[Register, Any]],
    host: str,
    port: int,
    workers: int,
    thread_name: str,
    security: ServerSecurity | None = None,
    unix_socket: Path | None = None,
    max_message_bytes: int = MESSAGE_LIMIT,
) -> tuple[grpc.Server, int]:
    """Serve ``services`` ((add_XServicer_to_server, servicer) pairs) on host:port (port 0
    picks a free one) and, with ``unix_socket``, on that socket too. Returns (server, bound
    TCP port)."""
    # always one: it also decodes requests (malformed ones answer INVALID_ARGUMENT)
    interceptors = [
        AuthInterceptor(security.authenticator, security.permissions)
        if security is not None
        else AuthInterceptor(None, {})
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    for register, servicer in services:
        register(servicer, server)
    tls = security.tls if security is not None else None
    if tls is not None and tls.cert_file is not None and tls.key_file is not None:
        creds = grpc.ssl_server_credentials(
            [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
            root_certificates=_read(tls.ca_file),
            require_client_auth=tls.ca_file is not None,
        )
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on {host}:{port}")
    if unix_socket is not None:
        prepare_socket_dir(unix_socket)
        if not server.add_insecure_port(f"unix:{unix_socket}"):
            raise KvtierError(ErrorCode.UNAVAILABLE, f"cannot listen on unix:{unix_socket}")
    server.start()
    if unix_socket is not None:
        unix_socket.chmod(0o600)
    return server, bound
