"""The rules of ``api.ChunkIndex`` that every implementation enforces the same way: the memory
and Redis backends, and the API's per-caller access layer in front of them.

A bad write is refused before anything changes (``check_ops``, ``check_holdings``,
``check_registration``), a query's keys are resolved the same way everywhere
(``resolve_keys``), ``apply`` follows one cursor rule (``check_cursor``), holdings come back in
one order (``order_holdings``), and a refusal is one of the errors below, worded once so that
an answer cannot tell one implementation (or another tenant's namespace) from another.

Layer: the index's side, not its api: clients never import it (they are answered with these
errors, they do not raise them). May import: ``kvtier.index.api``, ``kvtier.store.api``,
``kvtier.core``.

Threading: pure functions and constants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import KEY_BYTES, Namespace, check_keys, chunk_keys
from kvtier.index.api import (
    INDEX_TIERS,
    TIER_INDEX,
    ApplyStatus,
    ChunkOp,
    Cursor,
    Holding,
    LocationStatus,
    Query,
    Registration,
)
from kvtier.store.api.events import EventKind


# The answers for a namespace the index does not know. The API gives exactly these for a
# namespace the caller may not see (another tenant's): one helper per operation keeps them
# byte-identical (``index.access``).
def unknown_namespace(ns_id: bytes) -> KvtierError:
    """A query's."""
    return KvtierError(
        ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} is not known to the index"
    )


def unregistered_namespace(ns_id: bytes) -> KvtierError:
    """A write's (apply, replace)."""
    return KvtierError(ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} is not registered")


def unserved_namespace(ns_id: bytes) -> KvtierError:
    """A location registration's."""
    return KvtierError(
        ErrorCode.UNKNOWN_NAMESPACE,
        f"register namespace {ns_id.hex()} before a location that serves it",
    )


def unknown_location(location: str) -> KvtierError:
    return KvtierError(ErrorCode.UNKNOWN_LOCATION, f"location {location!r} is not registered")


def too_many_namespaces(limit: int) -> KvtierError:
    return KvtierError(
        ErrorCode.LIMIT_EXCEEDED,
        f"the index knows {limit} namespaces (index.max_namespaces): refusing another",
    )


def check_ops(ops: Sequence[ChunkOp], known_ns: Mapping[bytes, object]) -> None:
    """Validate a batch before touching anything, so a bad batch changes nothing."""
    for op in ops:
        if op.kind is EventKind.CLEARED:
            if op.tier is not None and op.tier not in TIER_INDEX:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"no index tier {op.tier}")
            continue
        if op.tier not in TIER_INDEX:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"entries name a tier of {INDEX_TIERS}, not {op.tier}"
            )
        if op.ns_id not in known_ns:
            raise unregistered_namespace(op.ns_id)
        check_keys(op.keys)


def check_holdings(
    holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]], known_ns: Mapping[bytes, object]
) -> None:
    for tier, by_ns in holdings.items():
        check_ops(
            [ChunkOp(EventKind.STORED, tier, ns, tuple(k)) for ns, k in by_ns.items()], known_ns
        )


def resolve_keys(query: Query, namespaces: Mapping[bytes, Namespace | None]) -> list[bytes]:
    """The chunk keys a query asks about (computing them from token ids when given those)."""
    if query.ns_id not in namespaces:
        raise unknown_namespace(query.ns_id)
    if (query.keys is None) == (query.tokens is None):
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a query gives keys or tokens, not both")
    if query.keys is not None:
        keys = list(query.keys)
        check_keys(keys)
        return keys
    namespace = namespaces[query.ns_id]
    if namespace is None:
        raise KvtierError(
            ErrorCode.UNKNOWN_NAMESPACE,
            f"namespace {query.ns_id.hex()} is known by id only (from store events): query by "
            "keys, or register its definition",
        )
    try:
        return chunk_keys(query.ns_id, query.tokens, namespace.chunk_tokens)
    except ValueError as exc:
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc


def check_seq_range(seq_from: int, seq_to: int) -> None:
    """A batch's sequence range: none (``seq_to`` 0) or 1-based ``seq_from..seq_to``."""
    if seq_to and (seq_from <= 0 or seq_from > seq_to):
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, f"bad sequence range {seq_from}..{seq_to} (1-based)"
        )


def check_cursor(
    status: LocationStatus, cursor: Cursor, epoch: int, seq_from: int, seq_to: int
) -> ApplyStatus | None:
    """The cursor rule of ``apply``; None = apply."""
    if status is not LocationStatus.UP:
        return ApplyStatus.RESYNC
    if seq_to == 0:
        return None
    check_seq_range(seq_from, seq_to)
    if epoch != cursor.epoch or cursor.epoch == 0:
        return ApplyStatus.RESYNC
    if seq_to <= cursor.seq:
        return ApplyStatus.DUPLICATE
    if seq_from > cursor.seq + 1:
        return ApplyStatus.RESYNC
    return None


def order_holdings(holdings: list[Holding]) -> tuple[Holding, ...]:
    holdings.sort(key=lambda h: (-h.total, -h.stored_at, h.location))
    return tuple(holdings)


# Bounds of one registration (it is kept for as long as the location is registered).
MAX_LOCATION_NAMESPACES = 16384  # a namespace named twice counts twice
MAX_ENDPOINTS = 16
MAX_ENDPOINT_CHARS = 1024


def check_registration(registration: Registration) -> None:
    name = registration.location
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT, f"a location id is 1-256 printable characters: {name!r}"
        )
    node = registration.node
    if not isinstance(node, str) or len(node) > 256 or not node.isprintable():
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a node id is 0-256 printable characters")
    if len(registration.namespaces) > MAX_LOCATION_NAMESPACES:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"a location serves at most {MAX_LOCATION_NAMESPACES} namespaces",
        )
    for ns_id in registration.namespaces:
        if not isinstance(ns_id, bytes) or len(ns_id) != KEY_BYTES:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a namespace id is 16 bytes")
    endpoints = registration.endpoints
    if len(endpoints) > MAX_ENDPOINTS or any(
        len(k) > 64 or len(v) > MAX_ENDPOINT_CHARS or not (k + v).isprintable()
        for k, v in endpoints.items()
    ):
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"at most {MAX_ENDPOINTS} endpoints, each a printable name of at most 64 characters "
            f"and a value of at most {MAX_ENDPOINT_CHARS}",
        )
