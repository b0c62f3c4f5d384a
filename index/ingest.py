"""Feeding the index: followers of sources, and the manager that runs them.

A *follower* owns one source (a vLLM engine's KV events, a node store's event stream), turns
its events into chunk ops, and writes them to the index with the source's sequence numbers.
It keeps the index right across gaps, restarts and outages with one rule: when the index
answers RESYNC (or was unreachable), send the source's whole state with ``replace``. The same
when the backend lost its data (``ChunkIndex.backend_resets`` grew: a Redis restarted empty);
the index reports itself not ready (``ResyncGate``) until every source it waits for did.

Replicas of the index that share a Redis all follow the same sources; ``ChunkIndex.claim``
makes exactly one of them the writer of each source, the others stand by warm.

The ``IngestManager`` starts followers for the configured sources and for registrations that
name endpoints (``Register`` over the API, possibly on another replica), and reaps locations
that stopped sending heartbeats.

Threading: one thread per follower, one housekeeping thread. Followers own their sockets and
their mapper; their ``SourceStats`` are plain counters read by the metrics collector.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtier.config_index import IndexConfig, StoreSource, VllmSource
from kvtier.errors import KvtierError
from kvtier.index.api import (
    ChunkIndex,
    ForwardingIndex,
    HeartbeatStatus,
    IndexHealth,
    Registration,
)
from kvtier.rpc import ClientAuth

log = logging.getLogger(__name__)


class SourceState(enum.StrEnum):
    STARTING = "starting"
    CATCHING_UP = "catching_up"  # replaying what the source buffered / taking a snapshot
    LIVE = "live"
    STANDBY = "standby"  # another replica writes this source
    UNREACHABLE = "unreachable"
    FAILED = "failed"  # cannot follow (bad configuration); see detail


@dataclass
class SourceStats:
    """What a follower did; counters only grow."""

    source: str
    kind: str  # vllm | store
    state: SourceState = SourceState.STARTING
    detail: str = ""
    events: Counter[str] = field(default_factory=Counter)  # by event type
    batches: int = 0
    blocks: int = 0  # vLLM blocks stored
    gaps_recovered: int = 0
    gaps_lost: int = 0  # batches that could not be recovered
    rejected: Counter[str] = field(default_factory=Counter)  # by reason
    resyncs: int = 0  # whole-state writes
    restarts: int = 0  # the source restarted (new incarnation)

    def snapshot(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "state": self.state.value,
            "detail": self.detail,
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
        self, name: str, kind: str, index: ChunkIndex, config: IndexConfig, dynamic: bool
    ) -> None:
        super().__init__(name=f"kvtier-follow-{name}", daemon=True)
        self.index = index
        self.config = config
        self.dynamic = dynamic  # started for a registration (stopped when it goes away)
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
        *before* the write (a reset during the write is owed again)."""
        resets = self.index.backend_resets().resets
        if resets > max(self.resynced_for, self._reset_taken):
            self._reset_taken = resets
            return True
        return False

    def heard(self) -> None:
        self.heard_at = time.monotonic()
        if self.stats.state is SourceState.UNREACHABLE:
            self.stats.state = SourceState.LIVE
            self.stats.detail = ""


class IngestManager:
    """Runs the followers and the reaper of one index process."""

    def __init__(
        self, index: ChunkIndex, config: IndexConfig, store_auth: ClientAuth | None = None
    ) -> None:
        """``store_auth``: what the index presents to the stores it follows."""
        self.index = index
        self.config = config
        self.store_auth = store_auth
        self._zmq = zmq.Context()
        self._followers: dict[str, Follower] = {}  # by source key
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._housekeeping, name="kvtier-index-ingest")
        self.reaped: Counter[str] = Counter()
        self._unfollowable: set[str] = set()

    def start(self) -> None:
        for source in self.config.vllm:
            try:  # known as soon as the service is up (its follower registers it again)
                for ns in source.namespaces:
                    self.index.register_namespace(ns)
            except KvtierError as exc:
                log.warning("cannot register %s's namespaces yet: %s", source.instance, exc)
            self._start_vllm(source, dynamic=False)
        for store in self.config.stores:
            self._start_store(store, dynamic=False)
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            followers = list(self._followers.values())
            self._followers.clear()
        for follower in followers:
            follower.halt.set()
        for follower in followers:
            follower.stop()
        self._zmq.term()

    def sources(self) -> list[SourceStats]:
        with self._lock:
            return [f.stats for f in self._followers.values()]

    def resyncing(self) -> list[str]:
        """Sources that still owe the backend their whole state since it lost its data.

        Not waited for: standby followers (the replica holding the claim writes), failed or
        stopped ones, and sources silent for ``heartbeat_timeout_s`` (the index would drop
        them anyway; they send everything when they are heard again, as after any outage).
        Waiting for those would keep the whole index unready because of one dead engine.
        """
        resets = self.index.backend_resets().resets
        if not resets:
            return []
        now = time.monotonic()
        with self._lock:
            followers = list(self._followers.values())
        return sorted(
            f.stats.source
            for f in followers
            if f.resynced_for < resets
            and f.is_alive()
            and f.stats.state not in (SourceState.STANDBY, SourceState.FAILED)
            and now - f.heard_at < self.config.heartbeat_timeout_s
        )

    def readiness(self, health: tuple[IndexHealth, str]) -> tuple[IndexHealth, str]:
        """The backend's ``health``, or DEGRADED while sources resync after it lost its data:
        until then answers miss what those sources hold."""
        if health[0] is IndexHealth.OK:
            owed = self.resyncing()
            if owed:
                reason = self.index.backend_resets().reason
                return IndexHealth.DEGRADED, f"{reason}: resyncing {', '.join(owed)}"
        return health

    def _start_vllm(self, source: VllmSource, dynamic: bool) -> None:
        from kvtier.index.vllm_events import VllmFollower

        key = f"vllm:{source.instance}"
        with self._lock:
            if key in self._followers:
                return
            follower = VllmFollower(source, self.index, self.config, self._zmq, dynamic)
            self._followers[key] = follower
        follower.start()

    def _start_store(self, store: StoreSource, dynamic: bool) -> None:
        from kvtier.index.store_events import StoreFollower

        key = f"store:{store.address}"
        with self._lock:
            if key in self._followers:
                return
            follower = StoreFollower(store, self.index, self.config, dynamic, self.store_auth)
            self._followers[key] = follower
        follower.start()

    def _housekeeping(self) -> None:
        interval = min(self.config.probe_interval_s, self.config.heartbeat_timeout_s / 4)
        while not self._halt.wait(interval):
            try:
                # the backend's check that it still holds its data; before ``sync``, so that
                # registrations a reset took are written back before their absence stops a
                # dynamic follower (and its mapper's state)
                self.index.health()
                for name in self.index.reap(self.config.heartbeat_timeout_s):
                    log.warning("location %s silent for %.0f s: dropped", name,
                                self.config.heartbeat_timeout_s)  # fmt: skip
                    self.reaped[name] += 1
                self.sync()
            except KvtierError as exc:  # the backend is down: answers say degraded
                log.debug("housekeeping: %s", exc)
            except Exception:  # pragma: no cover - a bug; keep going
                log.exception("index housekeeping failed")

    def sync(self) -> None:
        """Follow every registered location that names endpoints; stop following those that
        were unregistered."""
        registrations = {info.registration.location: info.registration
                         for info in self.index.locations()}  # fmt: skip
        for reg in registrations.values():
            if reg.endpoints.get("events") and f"vllm:{reg.location}" not in self._followers:
                source = self._vllm_source(reg)
                if source is not None:
                    self._start_vllm(source, dynamic=True)
            address = reg.endpoints.get("store")
            if address and f"store:{address}" not in self._followers:
                self._start_store(StoreSource(address=address), dynamic=True)
        with self._lock:
            gone = [
                (key, f)
                for key, f in self._followers.items()
                if f.dynamic
                and (not f.is_alive() or (f.location and f.location not in registrations))
            ]
            for key, _ in gone:
                del self._followers[key]
        for _, follower in gone:
            follower.stop()

    def _vllm_source(self, reg: Registration) -> VllmSource | None:
        known = self.index.namespaces()
        namespaces = [known.get(ns) for ns in reg.namespaces]
        if not namespaces or any(ns is None for ns in namespaces):
            if reg.location not in self._unfollowable:  # say it once
                self._unfollowable.add(reg.location)
                log.warning("cannot follow %s: register its namespaces' definitions first",
                            reg.location)  # fmt: skip
            return None
        self._unfollowable.discard(reg.location)
        # a follower registers derived namespaces (LoRA, salts) too: follow the base ones only
        chunk = {ns.chunk_tokens for ns in namespaces if ns is not None}
        base = [ns for ns in namespaces if ns is not None and not ns.cache_salt and not ns.lora]
        return VllmSource(
            instance=reg.location,
            endpoint=reg.endpoints["events"],
            replay_endpoint=reg.endpoints.get("replay") or None,
            topic=reg.endpoints.get("topic", ""),
            namespaces=base or [ns for ns in namespaces if ns is not None][: len(chunk)],
            node=reg.node,
            api=reg.endpoints.get("api") or None,
        )


class ResyncGate(ForwardingIndex):
    """The backend as readiness probes see it: DEGRADED, with the reason, while this
    process's sources resync after the backend lost its data (``IngestManager.readiness``)."""

    def __init__(self, inner: ChunkIndex, ingest: IngestManager) -> None:
        super().__init__(inner)
        self.ingest = ingest

    def health(self) -> tuple[IndexHealth, str]:
        return self.ingest.readiness(self.inner.health())
