"""Before a process presents its token to a store at an address someone else announced (an
index following a node's store, a store fetching from a peer), the store proves it holds a
node credential: a challenge answered with ``kvtier.core.auth.prove``, sent with no token."""

from __future__ import annotations

import secrets

import grpc

from kvtier.core import rpc
from kvtier.core.auth import Authenticator, Principal
from kvtier.core.config.auth import Role
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.proto import store_pb2 as pb
from kvtier.store.proto import store_pb2_grpc

__all__ = ["verify_store"]


def verify_store(
    address: str, auth: rpc.ClientAuth | None, verifier: Authenticator, timeout_s: float
) -> Principal | None:
    """Check that the store at ``address`` holds a node credential before this process
    presents its own token there: a challenge answered with ``kvtier.core.auth.prove``, sent
    with no token. Returns the proved node credential (None: nothing secret to present, or
    the node's Unix socket). Raises PERMISSION_DENIED when the endpoint cannot prove one,
    UNAVAILABLE when it does not answer.

    Why: the index and the stores dial addresses that others announce; an address pointing
    at an attacker's server must not collect the index's or a node's token (issue: a tenant
    engine that registered its own endpoint received the index token)."""
    if auth is None or not auth.token or address.startswith("unix:"):
        return None
    if not verifier.enabled:
        raise KvtierError(
            ErrorCode.PERMISSION_DENIED,
            f"not presenting this process's credential to store {address}: it has no "
            "credentials table to check the store's proof against (configure auth.credentials "
            "with the node credentials, as the services that accept them have)",
        )
    nonce = secrets.token_bytes(32)
    channel = rpc.open_channel(address, rpc.ClientAuth(None, auth.tls))
    try:
        reply = store_pb2_grpc.StoreStub(channel).Prove(
            pb.ProveRequest(nonce=nonce), timeout=timeout_s
        )
    except grpc.RpcError as exc:
        error = rpc.error_from_rpc(exc, f"store {address}")
        if error.code is ErrorCode.UNAVAILABLE:
            raise error from None
        raise KvtierError(
            ErrorCode.PERMISSION_DENIED, f"store {address} did not prove a node credential"
        ) from None
    finally:
        channel.close()
    proved = verifier.verify_proof(nonce, reply.proof, (Role.NODE, Role.ADMIN))
    if proved is None:
        raise KvtierError(
            ErrorCode.PERMISSION_DENIED, f"store {address} did not prove a node credential"
        )
    return proved
