"""A follower: the thread that follows one source for the index, and what it reports.

A *follower* owns one source (a vLLM engine's KV events, a node store's event stream), turns
its events into chunk ops, and writes them to the index with the source's sequence numbers
(``vllm_events.VllmFollower``, ``store_events.StoreFollower``). Its rule for gaps, restarts
and outages: when the index answers RESYNC (or DUPLICATE for batches it never sent, or was
unreachable), send the source's whole state with ``replace``.

A follower started for a registration (``dynamic``) writes on behalf of the credential that
registered it (``owner``): only namespaces that credential may use, and never a location its
registrant removed. It tells readiness when the index is not learning its live source
(``blind``): writes refused or failing, or standing by while no replica writes it.

Threading: one thread per follower; ``stats`` is read from elsewhere (plain counters).
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.config.index import IndexConfig
from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace
from kvtier.index.api import ChunkIndex, HeartbeatStatus, LocationStatus

# May a follower write this namespace (its definition; None: known by id only)?
NamespaceFilter = Callable[[Namespace | None], bool]

log = logging.getLogger(__name__)


class SourceState(enum.StrEnum):
    STARTING = "starting"
    CATCHING_UP = "catching_up"  # replaying what the source buffered / taking a snapshot
    LIVE = "live"
    STANDBY = "standby"  # another replica writes this source
    UNREACHABLE = "unreachable"
    FAILED = "failed"  # cannot follow (bad configuration, credentials refused); see detail


# Not live, and not because the source is down: a configured source in one of these states
# for longer than ``source_grace_s`` makes the index not ready.
NOT_FOLLOWING = (SourceState.STARTING, SourceState.CATCHING_UP, SourceState.FAILED)


@dataclass
class SourceStats:
    """What a follower did; counters only grow."""

    source: str
    kind: str  # vllm | store
    state: SourceState = SourceState.STARTING
    detail: str = ""
    blind: str = ""  # why the index is not learning this live source ('' = it is)
    state_since: float = 0.0  # monotonic time ``state`` last changed
    events: Counter[str] = field(default_factory=Counter)  # by event type
    batches: int = 0
    blocks: int = 0  # vLLM blocks stored
    gaps_recovered: int = 0
    gaps_lost: int = 0  # batches that could not be recovered
    rejected: Counter[str] = field(default_factory=Counter)  # by reason
    resyncs: int = 0  # whole-state writes
    restarts: int = 0  # the source restarted (new incarnation)

    def __post_init__(self) -> None:
        self.state_since = time.monotonic()

    def __setattr__(self, name: str, value: Any) -> None:
        # followers set ``state`` in many places; readiness needs how long it has held
        if name == "state" and value is not getattr(self, "state", None):
            object.__setattr__(self, "state_since", time.monotonic())
        object.__setattr__(self, name, value)

    def snapshot(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "state": self.state.value,
            "detail": self.detail,
            "blind": self.blind,
            "events": dict(self.events),
            "batches": self.batches,
            "blocks": self.blocks,
            "gaps_recovered": self.gaps_recovered,
            "gaps_lost": self.gaps_lost,
            "rejected": dict(self.rejected),
            "resyncs": self.resyncs,
            "restarts": self.restarts,
        }


class Follower(threading.Thread, abc.ABC):
    """A thread following one source. Subclasses implement ``follow``."""

    def __init__(
        self,
        name: str,
        kind: str,
        index: ChunkIndex,
        config: IndexConfig,
        dynamic: bool,
        owner: str = "",
        may_write: NamespaceFilter | None = None,
    ) -> None:
        """``owner``: the credential whose registration it follows ('' = the operator's);
        ``may_write``: which namespaces that credential may write (default: all)."""
        super().__init__(name=f"kvtier-follow-{name}", daemon=True)
        self.index = index
        self.config = config
        self.dynamic = dynamic  # started for a registration (stopped when it goes away)
        self.registered_as = name  # dynamic: the registration that started it
        self.owner = owner
        self.may_write: NamespaceFilter = may_write or (lambda _: True)
        self.refused_ns: set[bytes] = set()  # namespaces it may not (or cannot) write
        self.blind_since: float | None = None
        self.stats = SourceStats(name, kind)
        self.halt = threading.Event()
        self._claim_due = 0.0
        self._writer = False
        self._beat_at = 0.0
        self.heard_at = 0.0  # monotonic time the source last showed life
        self.retry_at = 0.0  # after a failed write: when to try again
        # the backend reset (``BackendResets.resets``) this follower last sent its whole state
        # after; one started later owes none (it starts with a whole-state write anyway)
        self.resynced_for = index.backend_resets().resets
        self._reset_taken = self.resynced_for

    @property
    @abc.abstractmethod
    def location(self) -> str: ...

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where it follows the source (what a registration names)."""

    @abc.abstractmethod
    def follow(self) -> None:
        """Run until ``halt`` is set."""

    def run(self) -> None:
        try:
            self.follow()
        except Exception as exc:  # a bug: keep the service up, say so
            log.exception("follower %s failed", self.stats.source)
            self.stats.state = SourceState.FAILED
            self.stats.detail = repr(exc)

    def stop(self, timeout: float = 5.0) -> None:
        self.halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def is_writer(self) -> bool:
        """Hold (renewing as needed) the claim to write this source. False on standby;
        raises the backend's error when it cannot tell (the caller retries later)."""
        now = time.monotonic()
        if now >= self._claim_due:
            self._writer = False
            self._writer = self.index.claim(
                self.location, self.config.replica_id, self.config.claim_ttl_s
            )
            self._claim_due = now + self.config.claim_ttl_s / 3
        return self._writer

    def beat(self) -> HeartbeatStatus | None:
        """Tell the index the source is alive: at most once per probe interval, and only if
        the source showed life since the last time."""
        now = time.monotonic()
        if self.heard_at <= self._beat_at or now - self._beat_at < self.config.probe_interval_s:
            return None
        self._beat_at = now
        try:
            return self.index.heartbeat([self.location])[0]
        except KvtierError:
            return None

    def take_reset(self) -> bool:
        """True once per backend reset (the backend lost its data) this follower has not
        answered yet: the caller registers again and sends its whole state. Once that write
        succeeded, it sets ``resynced_for`` to ``index.backend_resets().resets`` as read
        *before* the write (a reset during the write is owed again). The writer claim went
        with the rest: it is asked for again before anything is written."""
        resets = self.index.backend_resets().resets
        if resets > max(self.resynced_for, self._reset_taken):
            self._reset_taken = resets
            self._claim_due = 0.0
            return True
        return False

    def blind(self, reason: str) -> None:
        """The source is alive but the index is not learning it (see the module doc)."""
        if self.blind_since is None:
            self.blind_since = time.monotonic()
        self.stats.blind = reason

    def unblind(self) -> None:
        """A write landed (or another replica's writes show): the index learns it."""
        self.blind_since = None
        self.stats.blind = ""

    def check_standby(self) -> None:
        """Standing by: another replica writes this source. Blind while its location shows
        no writer: missing, dropped, or with no whole-state write since it was registered
        (a cursor of epoch 0), e.g. after the backend lost its data under a foreign claim."""
        try:
            info = self.index.location(self.location) if self.location else None
        except KvtierError:
            return  # the backend is down: health says so
        if info is None or info.status is not LocationStatus.UP or not info.cursor.epoch:
            self.blind("standing by, but no replica writes it")
        else:
            self.unblind()

    def may_register(self) -> bool:
        """A follower started for a registration never creates its location: once the
        registrant unregistered it, registering it again would resurrect what it removed.
        It stops instead (``halt``)."""
        if not self.dynamic:
            return True
        if self.index.location(self.registered_as) is None:
            self.halt.set()
            return False
        return True

    def writable(self, namespace: Namespace | None, ns_id: bytes) -> bool:
        """May this follower write ``ns_id``? Counts and remembers the ones it may not."""
        if ns_id in self.refused_ns:
            return False
        if self.may_write(namespace):
            return True
        self.refused_ns.add(ns_id)
        self.stats.rejected["foreign_namespace"] += 1
        return False

    def heard(self) -> None:
        self.heard_at = time.monotonic()
        if self.stats.state is SourceState.UNREACHABLE:
            self.stats.state = SourceState.LIVE
            self.stats.detail = ""
