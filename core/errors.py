"""Error codes shared by every kvtier API (gRPC, HTTP, in-process).

A caller always gets one of these codes and a message that says what was wrong; the same
exception type is raised whether the store is embedded or across a socket.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed request: bad key length, negative size...
    UNKNOWN_NAMESPACE = "UNKNOWN_NAMESPACE"  # namespace id never registered with this store
    NAMESPACE_MISMATCH = "NAMESPACE_MISMATCH"  # key belongs to another namespace / re-registered
    WRONG_SIZE = "WRONG_SIZE"  # chunk size differs from the namespace's chunk size
    UNKNOWN_LEASE = "UNKNOWN_LEASE"  # lease id never issued, already released or reaped
    LEASE_EXPIRED = "LEASE_EXPIRED"  # lease outlived its expiry: what it guarded may be gone
    UNKNOWN_KEY = "UNKNOWN_KEY"  # key not in this lease / not stored
    POOL_EXHAUSTED = "POOL_EXHAUSTED"  # nothing evictable left (all pinned or being written)
    STALE_EPOCH = "STALE_EPOCH"  # request made against a previous incarnation of the store
    UNKNOWN_LOCATION = "UNKNOWN_LOCATION"  # index: instance/node never registered (or forgotten)
    UNAVAILABLE = "UNAVAILABLE"  # the service cannot be reached
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no credential, or one the service does not know
    PERMISSION_DENIED = "PERMISSION_DENIED"  # the credential does not allow this call/namespace
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"  # a configured bound (namespaces, sessions, batch share)
    UNKNOWN_SESSION = "UNKNOWN_SESSION"  # session closed or timed out: open a new one
    UNSUPPORTED = "UNSUPPORTED"  # the service does not offer this (an index with no change feed)
    INTERNAL = "INTERNAL"


class KvtierError(Exception):
    """An error with a stable code. ``str()`` gives ``CODE: message``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
