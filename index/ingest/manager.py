"""Feeding the index: followers of sources (``index.follower``), and the manager that runs
them.

A *follower* owns one source (a vLLM engine's KV events, a node store's event stream), turns
its events into chunk ops, and writes them to the index with the source's sequence numbers.
It keeps the index right across gaps, restarts and outages with one rule: when the index
answers RESYNC (or was unreachable), send the source's whole state with ``replace``. The same
when the backend lost its data (``ChunkIndex.backend_resets`` grew: a Redis restarted empty);
the index reports itself not ready (``ResyncGate``) until every source it waits for did.

Replicas of the index that share a Redis all follow the same sources; ``ChunkIndex.claim``
makes exactly one of them the writer of each source, the others stand by warm. A claim not
renewed lapses within ``index.max_claim_ttl_s`` whatever its claimant asked, and claims are
asked for again after the backend lost its data (they went with it).

The ``IngestManager`` starts followers for the configured sources and for registrations that
name endpoints (``Register`` over the API, possibly on another replica: at most
``index.max_dynamic_followers``), stops those whose registration was unregistered or reaped,
and reaps locations that stopped sending heartbeats. A follower started for a registration
writes on its owner's behalf: only namespaces the owner's credential may use.

Readiness: the index reports itself degraded while a source it follows is *blinded* for
longer than ``index.source_grace_s``: the source is alive but the index does not learn it
(its writes refused or failing, or standing by while no replica writes it), or a configured
source cannot be followed at all (refused, failed). A source that is down is not blinded:
its location is dropped after ``heartbeat_timeout_s`` and answers say nothing of it, which is
true; one dead engine must not make the whole index unready.

Threading: one thread per follower, one housekeeping thread. Followers own their sockets and
their mapper; their ``SourceStats`` are plain counters read by the metrics collector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping

import zmq

from kvtier.core.auth import Authenticator
from kvtier.core.config.index import IndexConfig, StoreSource, VllmSource
from kvtier.core.errors import KvtierError
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import (
    ChunkIndex,
    ForwardingIndex,
    IndexHealth,
    LocationInfo,
    LocationStatus,
    Registration,
)
from kvtier.index.ingest.follower import (
    NOT_FOLLOWING,
    Follower,
    NamespaceFilter,
    SourceState,
    SourceStats,
)

log = logging.getLogger(__name__)


class IngestManager:
    """Runs the followers and the reaper of one index process."""

    def __init__(
        self,
        index: ChunkIndex,
        config: IndexConfig,
        store_auth: ClientAuth | None = None,
        verify: Authenticator | None = None,
        owners: Mapping[str, frozenset[str] | None] | None = None,
    ) -> None:
        """``store_auth``: what the index presents to the stores it follows, once they proved
        a node credential known to ``verify`` (None: no credentials to check proofs against,
        which is only allowed where nothing is presented). ``owners``: credential name ->
        salt digests it may use (None: all; ``Authenticator.by_name``), for followers of
        registrations; a registration by a credential not listed there may write no namespace."""
        self.index = index
        self.config = config
        self.store_auth = store_auth
        self.verify = verify
        self.owners = owners
        self._zmq = zmq.Context()
        self._followers: dict[str, Follower] = {}  # by source key
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._housekeeping, name="kvtier-index-ingest")
        self.reaped: Counter[str] = Counter()
        self._unfollowable: set[str] = set()
        self.unfollowed = 0  # registrations not followed: past max_dynamic_followers

    def start(self) -> None:
        for source in self.config.vllm:
            try:  # known as soon as the service is up (its follower registers it again)
                for ns in source.namespaces:
                    self.index.register_namespace(ns)
            except KvtierError as exc:
                log.warning("cannot register %s's namespaces yet: %s", source.instance, exc)
            self._start_vllm(source)
        for store in self.config.stores:
            self._start_store(store)
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

    def followers(self) -> list[Follower]:
        with self._lock:
            return list(self._followers.values())

    def resyncing(self) -> list[str]:
        """Sources that still owe the backend their whole state since it lost its data.

        Not waited for: standby followers (the replica holding the claim writes; if none
        does, ``blinded`` says so), failed or stopped ones, and sources silent for
        ``heartbeat_timeout_s`` (the index would drop them anyway; they send everything when
        they are heard again, as after any outage). Waiting for those would keep the whole
        index unready because of one dead engine.
        """
        resets = self.index.backend_resets().resets
        if not resets:
            return []
        now = time.monotonic()
        return sorted(
            f.stats.source
            for f in self.followers()
            if f.resynced_for < resets
            and f.is_alive()
            and f.stats.state not in (SourceState.STANDBY, SourceState.FAILED)
            and now - f.heard_at < self.config.heartbeat_timeout_s
        )

    def blinded(self) -> list[str]:
        """Sources the index has not been learning for longer than ``source_grace_s`` (see
        the module doc), each with why; no source details (``/readyz`` is open)."""
        now = time.monotonic()
        grace = self.config.source_grace_s
        out = []
        for f in self.followers():
            s = f.stats
            since = f.blind_since
            if (
                since is not None
                and now - since > grace
                and now - f.heard_at < self.config.heartbeat_timeout_s
            ):
                out.append(f"{s.source} ({s.blind}, {now - since:.0f} s)")
            elif not f.dynamic and s.state in NOT_FOLLOWING and now - s.state_since > grace:
                out.append(f"{s.source} ({s.state.value}, {now - s.state_since:.0f} s)")
        return sorted(out)

    def readiness(self, health: tuple[IndexHealth, str]) -> tuple[IndexHealth, str]:
        """The backend's ``health``, or DEGRADED while sources resync after it lost its data
        (until then answers miss what those sources hold), or while sources are blinded."""
        if health[0] is IndexHealth.OK:
            owed = self.resyncing()
            if owed:
                reason = self.index.backend_resets().reason
                return IndexHealth.DEGRADED, f"{reason}: resyncing {', '.join(owed)}"
            blind = self.blinded()
            if blind:
                return IndexHealth.DEGRADED, f"not learning followed sources: {'; '.join(blind)}"
        return health

    def _may_write(self, owner: str) -> NamespaceFilter:
        """What a follower of ``owner``'s registration may write (the rule of the API)."""
        if not owner or self.owners is None:
            return lambda _: True
        salts = self.owners.get(owner, frozenset())  # a credential since removed: nothing
        if salts is None:
            return lambda _: True
        return lambda ns: ns is not None and ns.cache_salt in salts

    def _start_vllm(self, source: VllmSource, registration: Registration | None = None) -> bool:
        from kvtier.index.ingest.vllm_events import VllmFollower

        key = f"vllm:{source.instance}"
        owner = registration.owner if registration is not None else ""
        with self._lock:
            if key in self._followers:
                return False
            follower = VllmFollower(
                source, self.index, self.config, self._zmq, registration is not None
            )
            follower.owner, follower.may_write = owner, self._may_write(owner)
            self._followers[key] = follower
        follower.start()
        return True

    def _start_store(self, store: StoreSource, registration: Registration | None = None) -> bool:
        """``registration``: the one it is followed for (dynamic); its owner's credential is
        the one the store must prove holding. None: configured, any node credential."""
        from kvtier.index.ingest.store_events import StoreFollower

        key = f"store:{store.address}"
        with self._lock:
            if key in self._followers:
                return False
            follower = StoreFollower(
                store, self.index, self.config, registration is not None, self.store_auth,
                verify=self.verify,
            )  # fmt: skip
            if registration is not None:
                follower.registered_as = registration.location
                follower.owner = registration.owner
                follower.may_write = self._may_write(registration.owner)
            self._followers[key] = follower
        follower.start()
        return True

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
        """Follow every registered location that names endpoints (at most
        ``max_dynamic_followers`` of them); stop following those that were unregistered,
        dropped for silence (their registrant registers them again when back), or
        registered again with other endpoints or by another credential."""
        infos = {info.registration.location: info for info in self.index.locations()}
        with self._lock:
            gone = [
                (key, f)
                for key, f in self._followers.items()
                if f.dynamic and _stale(f, infos.get(f.registered_as))
            ]
            for key, _ in gone:
                del self._followers[key]
            dynamic = sum(1 for f in self._followers.values() if f.dynamic)
        for _, follower in gone:  # all told first: each may be waiting on a dead endpoint
            follower.halt.set()
        for _, follower in gone:
            follower.stop()
        unfollowed = 0
        for info in infos.values():
            reg = info.registration
            events, address = reg.endpoints.get("events"), reg.endpoints.get("store")
            key = f"vllm:{reg.location}" if events else f"store:{address}" if address else ""
            if not key or info.status is not LocationStatus.UP or key in self._followers:
                continue
            if dynamic >= self.config.max_dynamic_followers:
                unfollowed += 1
                continue
            if events:
                source = self._vllm_source(reg)
                started = source is not None and self._start_vllm(source, reg)
            else:
                started = self._start_store(StoreSource(address=address or ""), reg)
            dynamic += started
        if unfollowed and not self.unfollowed:
            log.warning("%d registered sources not followed: the index follows at most %d "
                        "(index.max_dynamic_followers)", unfollowed,
                        self.config.max_dynamic_followers)  # fmt: skip
        self.unfollowed = unfollowed

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


def _stale(follower: Follower, info: LocationInfo | None) -> bool:
    """Should the dynamic ``follower`` stop, its registration being ``info`` now?"""
    if not follower.is_alive() or info is None or info.status is not LocationStatus.UP:
        return True
    reg = info.registration
    named = reg.endpoints.get("store" if follower.stats.kind == "store" else "events")
    return reg.owner != follower.owner or named != follower.endpoint


class ResyncGate(ForwardingIndex):
    """The backend as readiness probes see it: DEGRADED, with the reason, while this
    process's sources resync after the backend lost its data (``IngestManager.readiness``)."""

    def __init__(self, inner: ChunkIndex, ingest: IngestManager) -> None:
        super().__init__(inner)
        self.ingest = ingest

    def health(self) -> tuple[IndexHealth, str]:
        return self.ingest.readiness(self.inner.health())
