"""What the Redis backend's values mean in Python: the scripts' arguments built and their
answers read (``redis_lua`` has the scripts and the key layout; ``redis`` calls them).

- a location's registration, stored as JSON in its ``loc:<name>`` hash (field ``reg``);
- a location's hash read back as ``LocationInfo`` (``LOC_FIELDS``, in that order);
- a batch of ops as the ``APPLY`` script's ARGV;
- the ``QUERY`` script's answer (per slot and per location runs) as holdings.

Pure functions: no Redis connection, no state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.chunks import Tier
from kvtier.index.api import (
    INDEX_TIERS,
    TIER_BITS,
    TIER_INDEX,
    ChunkOp,
    Cursor,
    Holding,
    LocationInfo,
    LocationKind,
    LocationStatus,
    Registration,
)
from kvtier.index.rules import order_holdings
from kvtier.store.api.events import EventKind

_KIND_CODE = {EventKind.STORED: "s", EventKind.REMOVED: "r", EventKind.CLEARED: "c"}
# the fields of a location's hash that ``location_info`` reads, in its order
LOC_FIELDS = ("reg", "status", "last_seen", "epoch", "seq", "idx")


def reg_to_json(reg: Registration) -> str:
    return json.dumps(
        {
            "location": reg.location,
            "kind": reg.kind.value,
            "namespaces": [ns.hex() for ns in reg.namespaces],
            "node": reg.node,
            "endpoints": dict(reg.endpoints),
            "owner": reg.owner,
        }
    )


def reg_from_json(text: bytes | str) -> Registration:
    data = json.loads(text)
    return Registration(
        location=data["location"],
        kind=LocationKind(data["kind"]),
        namespaces=tuple(bytes.fromhex(ns) for ns in data["namespaces"]),
        node=data["node"],
        endpoints=data["endpoints"],
        owner=data.get("owner", ""),  # registrations written before owners were recorded
    )


def location_info(raw: Sequence[Any], counts: Sequence[int]) -> LocationInfo:
    """A location from its hash's ``LOC_FIELDS`` (``reg`` present) and its entry counts per
    tier (``INDEX_TIERS`` order)."""
    return LocationInfo(
        reg_from_json(raw[0]),
        LocationStatus(raw[1].decode()),
        float(raw[2]),
        Cursor(int(raw[3]), int(raw[4])),
        dict(zip(INDEX_TIERS, counts, strict=True)),
    )


def apply_args(
    prefix: bytes, epoch: int, seq_from: int, seq_to: int, now: float, ops: Sequence[ChunkOp]
) -> list[Any]:
    """``APPLY``'s ARGV: the prefix, the batch's cursor and time, then each op as (kind, tier
    (-1: all), key count, keys...)."""
    args: list[Any] = [prefix, str(epoch), seq_from, seq_to, repr(now)]
    for op in ops:
        tier = -1 if op.tier is None else TIER_INDEX[op.tier]
        args += [_KIND_CODE[op.kind], tier, len(op.keys), *op.keys]
    return args


def holdings_from_reply(
    slot_out: list, loc_out: list, registration: Callable[[str], Registration | None]
) -> tuple[Holding, ...]:
    """``QUERY``'s answer as holdings, in the rules' order. ``slot_out``: (slot, run) pairs;
    ``loc_out``: (idx, total run, stored at, name, last seen) per location; ``registration``
    names a location's kind and node (None: unknown, taken as an instance)."""
    runs: dict[int, dict[Tier, int]] = {}
    for i in range(0, len(slot_out), 2):
        idx, tier = divmod(int(slot_out[i]), TIER_BITS)
        if tier < len(INDEX_TIERS) and slot_out[i + 1]:
            runs.setdefault(idx, {})[INDEX_TIERS[tier]] = int(slot_out[i + 1])
    holdings = []
    for i in range(0, len(loc_out), 5):
        idx, total = int(loc_out[i]), int(loc_out[i + 1])
        name = loc_out[i + 3].decode()
        if not name or not total:  # pragma: no cover - forgotten between write and read
            continue
        reg = registration(name)
        holdings.append(
            Holding(
                name,
                reg.kind if reg else LocationKind.INSTANCE,
                reg.node if reg else "",
                runs.get(idx, {}),
                total,
                float(loc_out[i + 4]),
                float(loc_out[i + 2]),
            )
        )
    return order_holdings(holdings)
