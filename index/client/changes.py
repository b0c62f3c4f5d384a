"""What the index's change feed carries (``index/server/feed.py`` keeps it; a router's replica,
``index/client/replica.py``, reads it): each write the index applied, in order, snapshots of
the whole index as of a change, and router replicas' shares of what each alone sees (their
in-flight load, ejections, prompts just routed), relayed to the others."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace
from kvtier.index.api import ChunkOp, LocationInfo, Registration


class ChangeKind(enum.StrEnum):
    NAMESPACE = "namespace"
    REGISTER = "register"
    UNREGISTER = "unregister"
    DROP = "drop"
    APPLY = "apply"
    REPLACE = "replace"
    HEARTBEAT = "heartbeat"
    ROUTER = "router"  # a router replica's view of its instances (not the index's state)


@dataclass(frozen=True, slots=True)
class InstanceShare:
    """What one router replica knows of one instance that the others cannot see."""

    instance: str
    in_flight: int = 0  # requests it sent there and not yet answered
    pending_prefill_tokens: float = 0.0  # their prompt tokens not yet past the first token
    ejected_for_s: float = 0.0  # it ejected the instance, for this much longer (0: it did not)
    ejected_reason: str = ""


@dataclass(frozen=True, slots=True)
class RouterShare:
    """A router replica's share, every ``router.share_interval_s``: per instance its load and
    ejections, and the prompts it routed since its last share (chunk keys by instance and
    namespace: what the others count as speculatively held). Valid for ``ttl_s``."""

    router: str
    ttl_s: float
    instances: tuple[InstanceShare, ...] = ()
    routed: tuple[tuple[str, bytes, tuple[bytes, ...]], ...] = ()  # (instance, ns id, keys)


@dataclass(frozen=True, slots=True)
class Change:
    """One write the index applied. Which fields are set follows ``kind``."""

    seq: int
    kind: ChangeKind
    location: str = ""  # register (its registration's), unregister, drop, apply, replace
    namespace: Namespace | bytes | None = None  # namespace: its definition, or its id only
    registration: Registration | None = None
    ops: tuple[ChunkOp, ...] = ()
    holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]] | None = None
    locations: tuple[str, ...] = ()  # heartbeat
    share: RouterShare | None = None  # router


@dataclass(frozen=True, slots=True)
class FeedBatch:
    epoch: str
    changes: list[Change]
    last: int  # the newest change the feed holds (the reader is current once it applied it)
    gap: bool = False  # the reader must load a snapshot: changes after ``after`` are lost


@dataclass(slots=True)
class LocationDump:
    info: LocationInfo
    entries: dict[Tier, dict[bytes, float]] = field(default_factory=dict)  # key -> stored at


@dataclass(slots=True)
class IndexDump:
    """A whole index, as of change ``seq`` of feed ``epoch``."""

    epoch: str
    seq: int
    namespaces: dict[bytes, Namespace | None]
    locations: list[LocationDump]


class Dumpable(Protocol):
    def dump(self) -> tuple[dict[bytes, Namespace | None], list[LocationDump]]: ...


NO_FEED = (
    "this index keeps no change feed: replicas of it share a Redis and each writes only the "
    "sources it claimed (routers query the index instead)"
)
