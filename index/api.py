"""The chunk index's interface: where every chunk lives, one ABC for every backend.

A *location* is something that holds chunks: a vLLM instance (its GPU prefix cache, and the
CPU/disk tiers of vLLM's own offloading) or a node store (its DRAM pool). An *entry* says
"location L holds chunk K in tier T" and carries the wall-clock time it was written, so answers
can prefer fresh holders. Entries are hints: a consumer verifies at the source before loading,
so a stale entry costs a miss, never a wrong token.

Writers (event followers, or clients over the API) change entries with sequenced batches:
``apply(location, ops, epoch, seq_from, seq_to)``. The index keeps a cursor per location (the
epoch and sequence number of the newest batch it applied) and answers ``RESYNC`` when a batch
does not continue from it (a gap, another incarnation of the source, a location dropped for
silence); the writer then sends its whole state with ``replace``. Readers ask ``query``: for a
prompt (token ids or chunk keys), the longest leading run of chunks each location holds, per
tier and across tiers.

The rules every implementation enforces the same way (argument checks, the cursor rule, the
order of holdings, the errors a refusal is) are in ``index.rules``, the index's side.

Threading: every implementation is thread-safe. Ownership: results are plain frozen values;
the index owns its entries, writers own their sources' sequence numbers.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace
from kvtier.store.api.events import EventKind

# Tiers an entry can name. REMOTE is a consumer's point of view (another node's DRAM), not
# somewhere a chunk is held, so it is not one of them.
INDEX_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK)
TIER_BITS = 4  # slots per location in the backends' bitmaps: one per tier, one spare
TIER_INDEX = {tier: i for i, tier in enumerate(INDEX_TIERS)}


class LocationKind(enum.StrEnum):
    INSTANCE = "instance"  # a vLLM engine (GPU prefix cache, its own offload tiers)
    NODE = "node"  # a node store (DRAM pool)


class LocationStatus(enum.StrEnum):
    UP = "up"
    DOWN = "down"  # silent past the heartbeat timeout: its entries were dropped


class ApplyStatus(enum.StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # every batch in the range was applied before: nothing done
    RESYNC = "resync"  # nothing applied: send the whole state with ``replace``


class HeartbeatStatus(enum.StrEnum):
    OK = "ok"
    RESYNC = "resync"  # the location had been dropped: it is up again, send its state
    UNKNOWN = "unknown"  # never registered (or unregistered): register first


class IndexHealth(enum.StrEnum):
    OK = "ok"
    # the backend is (partly) unreachable, or resyncing after it lost its data: answers may be
    # empty or incomplete
    DEGRADED = "degraded"


@dataclass(frozen=True, slots=True)
class BackendResets:
    """What this process saw of its backend's lifetimes. A Redis index outlives index
    processes, but Redis itself may restart: with its data (nothing to do) or without (every
    writer must send its whole state again, see ``ChunkIndex.backend_resets``)."""

    resets: int = 0  # times the backend was found to have lost its data
    restarts: int = 0  # times it restarted with its data kept
    reason: str = ""  # the newest reset, for people
    recovering: bool = False  # still re-registering what this process knows after a reset


@dataclass(frozen=True, slots=True)
class ChunkOp:
    """One change to a location's entries. CLEARED drops a tier (``tier=None``: every tier)."""

    kind: EventKind
    tier: Tier | None
    ns_id: bytes = b""
    keys: tuple[bytes, ...] = ()


FOLLOWED_ENDPOINTS = ("events", "store")  # endpoints the index follows a location by


@dataclass(frozen=True, slots=True)
class Registration:
    """What a location says about itself. ``endpoints`` tell the index how to follow it:
    ``events`` (ZMQ PUB of vLLM KV events), ``replay`` (its ROUTER), ``topic``, ``store``
    (a node store's gRPC address).

    ``owner`` is what the index says about it, not the location: the name of the credential
    that registered it over the API, '' for an operator (an admin credential, the index's own
    configuration). Only the owner (or an admin) writes the location (``index.access``); the
    API sets it from the caller and never takes it from a request. Stored with the
    registration, so every replica and a restarted index enforce it too."""

    location: str
    kind: LocationKind
    namespaces: tuple[bytes, ...] = ()
    node: str = ""  # for an instance: the node it runs on ('' = unknown)
    endpoints: Mapping[str, str] = field(default_factory=dict)
    owner: str = ""

    @property
    def followed(self) -> bool:
        """The index follows this location from its endpoints: only its follower writes it."""
        return any(self.endpoints.get(name) for name in FOLLOWED_ENDPOINTS)


@dataclass(frozen=True, slots=True)
class Cursor:
    epoch: int  # incarnation of the writer's view of the source (0 = none yet)
    seq: int  # newest batch applied in that epoch


@dataclass(frozen=True, slots=True)
class LocationInfo:
    registration: Registration
    status: LocationStatus
    last_seen: float  # wall-clock seconds: newest event, heartbeat or replace
    cursor: Cursor
    entries: Mapping[Tier, int]  # chunk entries per tier


@dataclass(frozen=True, slots=True)
class Query:
    """A prompt, as chunk keys or as token ids (keys are computed with the namespace)."""

    ns_id: bytes
    keys: Sequence[bytes] | None = None
    tokens: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class Holding:
    """What one location holds of a prompt: leading runs, in chunks."""

    location: str
    kind: LocationKind
    node: str
    runs: Mapping[Tier, int]  # longest leading run per tier (tiers with a run > 0)
    total: int  # longest leading run where every chunk is held in some tier
    last_seen: float  # when the location last spoke (wall clock)
    stored_at: float  # when the entry for the run's last chunk was written (wall clock)


@dataclass(frozen=True, slots=True)
class QueryResult:
    ns_id: bytes
    num_chunks: int  # chunks in the prompt
    holdings: tuple[Holding, ...]  # locations holding a run > 0: longest first, then freshest
    health: IndexHealth = IndexHealth.OK

    def best(self) -> Holding | None:
        return self.holdings[0] if self.holdings else None

    def of(self, location: str) -> Holding | None:
        for holding in self.holdings:
            if holding.location == location:
                return holding
        return None


class ChunkIndex(abc.ABC):
    """The global chunk index: one interface for the in-memory and Redis backends and for the
    gRPC client of ``kvtier index serve``."""

    # -- namespaces and locations -------------------------------------------------------------

    @abc.abstractmethod
    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        """Make a namespace known: its definition (token queries need its ``chunk_tokens``)
        or only its id (what a store's events carry). Returns the namespace id."""

    @abc.abstractmethod
    def namespaces(self) -> dict[bytes, Namespace | None]:
        """Known namespaces: id -> definition (None when known by id only)."""

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        """(known, definition) of one namespace (definition None: known by id only)."""
        known = self.namespaces()
        return ns_id in known, known.get(ns_id)

    @abc.abstractmethod
    def register(self, registration: Registration) -> LocationInfo:
        """Create or update a location (status UP). Its namespaces must be known."""

    @abc.abstractmethod
    def unregister(self, location: str) -> bool:
        """Forget a location and its entries. False if it was not registered."""

    @abc.abstractmethod
    def locations(self) -> list[LocationInfo]: ...

    def location(self, name: str) -> LocationInfo | None:
        """One location (None: not registered)."""
        return next((i for i in self.locations() if i.registration.location == name), None)

    @abc.abstractmethod
    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        """Mark locations alive. A dropped one comes back UP and answers RESYNC."""

    @abc.abstractmethod
    def drop(self, location: str) -> bool:
        """Remove a location's entries and mark it DOWN (it stays registered)."""

    @abc.abstractmethod
    def reap(self, timeout_s: float) -> list[str]:
        """Drop every UP location silent for longer than ``timeout_s``; returns them."""

    # -- writes -------------------------------------------------------------------------------

    @abc.abstractmethod
    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        """Apply ops, in order, that cover source batches ``seq_from..seq_to`` of ``epoch``.

        ``seq_to == 0``: unsequenced (always applied while the location is UP). Otherwise
        applied when the range continues the cursor (``seq_from <= cursor.seq + 1`` in the same
        epoch; re-applying an overlap is harmless because ops replay in order), DUPLICATE when
        ``seq_to <= cursor.seq``, RESYNC for a gap, another epoch or a DOWN location.
        Raises UNKNOWN_LOCATION, UNKNOWN_NAMESPACE or INVALID_ARGUMENT (nothing applied).
        """

    @abc.abstractmethod
    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        """Set a location's whole state (tiers not given become empty) and its cursor; UP."""

    def claim(self, location: str, owner: str, ttl_s: float) -> bool:
        """Become (or stay) the one writer of ``location`` for ``ttl_s`` seconds.

        Index replicas that share a backend follow the same sources; only the claimant
        writes. A single-process backend has one writer, so the default always grants.
        """
        return True

    # -- reads --------------------------------------------------------------------------------

    @abc.abstractmethod
    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        """For each prompt, what every location holds of it (see ``Holding``).

        Cost is O(chunks in the prompt), not O(index). Raises UNKNOWN_NAMESPACE for a
        namespace the index does not know (or knows by id only, for a token query).
        """

    def query_one(self, query: Query) -> QueryResult:
        return self.query([query])[0]

    @abc.abstractmethod
    def stats(self) -> dict[str, int | float | str]: ...

    @abc.abstractmethod
    def health(self) -> tuple[IndexHealth, str]:
        """OK or DEGRADED, with a reason people can act on."""

    def backend_resets(self) -> BackendResets:
        """Whether the backend lost its data while this process used it (no I/O: what the
        last health check or failed write found).

        Writers in this process compare ``resets`` with the count they last sent their whole
        state for, and ``replace`` when it grew: a cursor check cannot tell them, since the
        cursors were lost too. Backends that live and die with the process never reset.
        """
        return BackendResets()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (connections, threads)."""

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ForwardingIndex(ChunkIndex):
    """Delegates every call to ``inner``; wrappers (metrics, embedded runtime) override some."""

    def __init__(self, inner: ChunkIndex) -> None:
        self.inner = inner

    def register_namespace(self, namespace: Namespace | bytes) -> bytes:
        return self.inner.register_namespace(namespace)

    def namespaces(self) -> dict[bytes, Namespace | None]:
        return self.inner.namespaces()

    def namespace(self, ns_id: bytes) -> tuple[bool, Namespace | None]:
        return self.inner.namespace(ns_id)

    def register(self, registration: Registration) -> LocationInfo:
        return self.inner.register(registration)

    def unregister(self, location: str) -> bool:
        return self.inner.unregister(location)

    def locations(self) -> list[LocationInfo]:
        return self.inner.locations()

    def location(self, name: str) -> LocationInfo | None:
        return self.inner.location(name)

    def heartbeat(self, locations: Sequence[str]) -> list[HeartbeatStatus]:
        return self.inner.heartbeat(locations)

    def drop(self, location: str) -> bool:
        return self.inner.drop(location)

    def reap(self, timeout_s: float) -> list[str]:
        return self.inner.reap(timeout_s)

    def apply(
        self,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int = 0,
        seq_from: int = 0,
        seq_to: int = 0,
    ) -> ApplyStatus:
        return self.inner.apply(location, ops, epoch=epoch, seq_from=seq_from, seq_to=seq_to)

    def replace(
        self,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        self.inner.replace(location, holdings, epoch=epoch, seq=seq)

    def claim(self, location: str, owner: str, ttl_s: float) -> bool:
        return self.inner.claim(location, owner, ttl_s)

    def query(self, queries: Sequence[Query]) -> list[QueryResult]:
        return self.inner.query(queries)

    def stats(self) -> dict[str, int | float | str]:
        return self.inner.stats()

    def health(self) -> tuple[IndexHealth, str]:
        return self.inner.health()

    def backend_resets(self) -> BackendResets:
        return self.inner.backend_resets()

    def close(self) -> None:
        self.inner.close()
