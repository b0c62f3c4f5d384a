"""The engine's hot path to its node store: framed messages on a Unix socket, beside gRPC.

Why: one Python gRPC call pair costs 0.7-2 ms here against ~20 µs for a raw Unix-socket
ping-pong (``kvtier bench control``); the cost is gRPC's Python stack, not the transport.
The calls an engine makes every step (lookup with lease, allocate, commit, abort, release,
renew) travel here instead; everything else (namespaces, sessions, stats, events, fetches,
peers, admin) stays on gRPC, which remains the API of record.

Wire (defined in ``kvtier.store.client.control``, the other end): every message is a 5-byte header,
``<IB`` = payload length and an opcode (request) or a status (reply), then the payload. A
request's payload is the same protobuf message its gRPC method takes (``store.proto``); an OK
reply's is the gRPC method's reply; an error reply's is ``<code>\\0<message>`` in UTF-8 with
the kvtier ``ErrorCode`` value. ``BATCH`` carries several requests (each a header and payload)
and answers with as many replies, in order: one message for a step's work.

Trust: the socket lives in ``store.run_dir`` (0700, the store's uid), is made 0600, and the
kernel's ``SO_PEERCRED`` must name the store's uid (or root) — the same bar as the store's
gRPC Unix socket. A connection's first message is ``HELLO`` with the caller's token (empty for
the node's own): a tenant-limited engine's token makes every request pass the same tenant
gate as over gRPC (``TenantGate``); an unknown token closes the connection. Every request is
checked against the store's epoch as over gRPC (STALE_EPOCH after a restart).

Threading: one daemon thread accepts, one serves each connection (an engine holds a few: one
per thread that calls the store). Handlers run the gRPC servicer's own methods, so a call
means exactly what it means over gRPC and is timed in the same metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.core import rpc
from kvtier.core.auth import LOCAL, Authenticator, Permission, Principal
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.client.control import (
    ABORT,
    ALLOCATE,
    BATCH,
    COMMIT,
    ERROR,
    HEADER,
    HELLO,
    LOOKUP,
    OK,
    RELEASE,
    RENEW,
    error_payload,
    peer_uid,
    recv_frame,
)
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.server.grpc import StoreServicer

log = logging.getLogger(__name__)


# opcode -> (the servicer method that answers it, its request message)
OPS: dict[int, tuple[str, type[Any]]] = {
    LOOKUP: ("Lookup", pb.LookupRequest),
    ALLOCATE: ("Allocate", pb.AllocateRequest),
    COMMIT: ("Commit", pb.CommitRequest),
    ABORT: ("Abort", pb.AbortRequest),
    RELEASE: ("Release", pb.ReleaseRequest),
    RENEW: ("Renew", pb.RenewRequest),
}


class ControlServer:
    """Serves ``servicer``'s hot-path methods on the Unix socket ``path`` until ``stop``."""

    def __init__(
        self,
        servicer: StoreServicer,
        path: Path,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.servicer = servicer
        self.path = path
        self._auth = authenticator
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        # ``path`` is in store.run_dir, which the store checked is its own and writable by
        # nobody else. Bound under another name and renamed once 0600: nobody can connect
        # in between (a socket is made with the umask's mode).
        staging = path.with_name(path.name + ".new")
        for stale in (staging, path):
            if stale.is_socket():
                stale.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(staging))
        staging.chmod(0o600)
        staging.rename(path)
        self._listener.listen(64)
        self._methods: dict[int, tuple[Callable[..., Any], type[Any]]] = {
            op: (getattr(StoreServicer, name).__wrapped__, message)
            for op, (name, message) in OPS.items()
        }
        # frames received and the calls they carried (a BATCH carries several): what an
        # engine's steps cost the store in messages (``kvtier bench decode-overhead``)
        self._messages = 0
        self._calls = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="kvtier-ctl", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        with self._count_lock:
            return {"control_messages": self._messages, "control_calls": self._calls}

    def _counted(self, calls: int) -> None:
        with self._count_lock:
            self._messages += 1
            self._calls += calls

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not _same_uid(conn):
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kvtier-ctl-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            principal = self._hello(conn)
            with rpc.acting_as(principal):  # the tenant gate reads the caller from here
                while True:
                    op, payload = recv_frame(conn)  # too large a frame: dropped
                    if op == BATCH:
                        reply, calls = self._batch(payload)
                        conn.sendall(reply)
                    else:
                        conn.sendall(self._answer(op, payload))
                        calls = 1
                    self._counted(calls)
        except (ConnectionError, OSError, KvtierError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> Principal:
        op, payload = recv_frame(conn)
        if op != HELLO or len(payload) > 4096:
            raise KvtierError(ErrorCode.UNAUTHENTICATED, "a connection starts with HELLO")
        token = payload.decode()
        principal = LOCAL
        if token and self._auth is not None:
            try:
                principal = self._auth.principal(token)
                principal.require(Permission.STORE_DATA, "use the store's control socket")
            except KvtierError as exc:
                payload = error_payload(exc)
                conn.sendall(HEADER.pack(len(payload), ERROR) + payload)
                raise
        conn.sendall(HEADER.pack(0, OK))
        return principal

    def _answer(self, op: int, payload: bytes) -> bytes:
        """One request's reply frame."""
        try:
            found = self._methods.get(op)
            if found is None:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"unknown control opcode {op}")
            method, message = found
            request = message.FromString(payload)
            self.servicer.check(request)
            body = method(self.servicer, request, None).SerializeToString()
            return HEADER.pack(len(body), OK) + body
        except KvtierError as exc:
            body = error_payload(exc)
        except (ValueError, TypeError) as exc:  # malformed fields, as over gRPC
            body = error_payload(KvtierError(ErrorCode.INVALID_ARGUMENT, str(exc)))
        except Exception as exc:  # a bug: keep serving, as the gRPC handler does
            log.exception("internal error in control opcode %d", op)
            body = error_payload(KvtierError(ErrorCode.INTERNAL, repr(exc)))
        return HEADER.pack(len(body), ERROR) + body

    def _batch(self, payload: bytes) -> tuple[bytes, int]:
        """A BATCH's reply frame and how many calls it carried."""
        replies, at = [], 0
        while at < len(payload):
            length, op = HEADER.unpack_from(payload, at)
            at += HEADER.size
            replies.append(self._answer(op, payload[at : at + length]))
            at += length
        body = b"".join(replies)
        return HEADER.pack(len(body), OK) + body, len(replies)

    def stop(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.path.unlink()


def _same_uid(conn: socket.socket) -> bool:
    """The kernel's word for who connected (``SO_PEERCRED``): the store's uid, or root."""
    return peer_uid(conn) in (os.getuid(), 0)
