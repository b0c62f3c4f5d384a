"""The store's event stream as consumers see it: what entered and left the pool, in
sequence-numbered batches, or the gap a consumer that fell behind must recover from (with a
snapshot). The log itself is ``kvtier.store.state.eventlog``."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    kind: EventKind
    namespace: bytes = b""  # namespace id (its root key); empty for CLEARED
    keys: tuple[bytes, ...] = ()
    tier: str = "cpu"


@dataclass(frozen=True, slots=True)
class EventBatch:
    node_id: str
    epoch: int
    seq: int
    timestamp: float
    events: tuple[StoreEvent, ...]


@dataclass(frozen=True, slots=True)
class EventGap:
    """The log no longer holds ``requested``; the oldest it holds is ``oldest``."""

    requested: int
    oldest: int
