"""The instances the router may send a request to, and what it knows of each: where it is,
what its KV is (namespace, node), how loaded it is, whether it is healthy.

Sources: ``router.backends`` (listed by hand) and, with ``router.discover``, every instance
that announced an ``api`` endpoint to the index (the connector does, with
``connector.instance_api``) whose URL the ``DiscoveryPolicy`` admits (``discovery.py``: an
announcement alone is not trusted). ``refresh`` re-reads the index; an instance added or gone
is picked up while serving.

Load is the router's own accounting (prompt tokens dispatched and not yet answered with a
first token: pending prefill; requests in flight) plus what ``/metrics`` scrapes say
(waiting requests, KV usage). An instance that failed (connection error, 5xx, a failed
probe) is ejected for ``eject_s``; an ejected instance is never a candidate, however much of
a prompt it holds.

Threading: one lock guards the table; the proxy's event loop and the refresh thread share it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvtier.core import engine_hint
from kvtier.core.config.router import RouterConfig
from kvtier.index.api import ChunkIndex, LocationKind, LocationStatus
from kvtier.router.discovery import DiscoveryPolicy
from kvtier.router.policies import Load

log = logging.getLogger(__name__)


@dataclass
class Backend:
    name: str  # its location in the index, or its URL when it has none
    url: str
    node: str = ""
    namespace: bytes | None = None  # rank 0's namespace id (what the index answers about)
    static: bool = False
    reads_hint: bool = False  # its connector reads the router's word (kvtier.core.engine_hint)
    # the router's own accounting
    pending_prefill_tokens: float = 0.0
    in_flight: int = 0
    # scraped from /metrics
    scraped_running: int = 0
    scraped_waiting: int = 0
    kv_usage: float = 0.0
    # health
    ejected_until: float = 0.0
    ejected_reason: str = ""
    # what the other router replicas share of it (router/peers.py)
    peer: PeerView = field(default_factory=lambda: PeerView())

    def load(self) -> Load:
        return Load(
            pending_prefill_tokens=self.pending_prefill_tokens + self.peer.pending_prefill_tokens,
            running=max(self.in_flight + self.peer.in_flight, self.scraped_running),
            waiting=self.scraped_waiting,
            kv_usage=self.kv_usage,
        )

    def ejected(self, now: float) -> bool:
        """Ejected here, or by another replica (for what is left of its ejection)."""
        return self.ejected_until > now or self.peer.ejected_until > now


@dataclass
class PeerView:
    """The other router replicas' shares of one instance, summed (fresh shares only)."""

    in_flight: int = 0
    pending_prefill_tokens: float = 0.0
    ejected_until: float = 0.0  # monotonic, here
    ejected_reason: str = ""


class NoBackend(Exception):
    """Nothing to route to: ``saturated`` (all busy: 429) or none healthy (503)."""

    def __init__(self, saturated: bool, message: str) -> None:
        super().__init__(message)
        self.saturated = saturated


class Backends:
    def __init__(
        self,
        config: RouterConfig,
        index: ChunkIndex | None = None,
        discovery: DiscoveryPolicy | None = None,
    ) -> None:
        """``discovery``: which announced instances to admit (default: as configured for a
        deployment with credentials, i.e. ``router.discover_allow`` or none)."""
        self.config = config
        self.index = index
        self.discovery = discovery or DiscoveryPolicy.from_config(config, anonymous=False)
        self._lock = threading.Lock()
        self._by_name: dict[str, Backend] = {}
        for spec in config.backends:
            name = spec.name or spec.url
            self._by_name[name] = Backend(name, spec.url.rstrip("/"), spec.node, static=True)

    def refresh(self) -> None:
        """Re-read announced instances (and the namespace/node of listed ones) from the index.
        An index that does not answer changes nothing: routing goes on with what is known."""
        if self.index is None:
            return
        try:
            infos = self.index.locations()
        except Exception as exc:
            log.warning("router: index unreachable, keeping %d backends: %s", len(self), exc)
            return
        announced: dict[str, tuple[str, str, bytes | None, bool]] = {}
        for info in infos:
            reg = info.registration
            if reg.kind is not LocationKind.INSTANCE or info.status is not LocationStatus.UP:
                continue
            namespace = reg.namespaces[0] if reg.namespaces else None
            reads = reg.endpoints.get(engine_hint.READER_ENDPOINT) == engine_hint.READER
            announced[reg.location] = (reg.endpoints.get("api", ""), reg.node, namespace, reads)
        with self._lock:
            static = {n for n, b in self._by_name.items() if b.static}
        # decided outside the lock (a refusal logs); listed instances keep their own URL
        admitted = {
            name
            for name, (url, _, _, _) in announced.items()
            if name not in static
            and url
            and self.config.discover
            and self.discovery.check(name, url.rstrip("/"))
        }
        with self._lock:
            for name, (url, node, namespace, reads) in announced.items():
                backend = self._by_name.get(name)
                if backend is not None and (backend.static or name in admitted):
                    # listed by hand, or known: learn its KV identity (and a moved URL)
                    backend.namespace, backend.node = namespace, node or backend.node
                    backend.reads_hint = reads
                    if not backend.static and backend.url != url.rstrip("/"):
                        log.info("router: instance %s moved to %s", name, url)
                        backend.url = url.rstrip("/")
                elif name in admitted:
                    self._by_name[name] = Backend(
                        name, url.rstrip("/"), node, namespace, reads_hint=reads
                    )
                    log.info("router: instance %s at %s joined", name, url)
            for name in [n for n, b in self._by_name.items() if not b.static]:
                if name not in admitted:
                    del self._by_name[name]
                    log.info("router: instance %s left", name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def all(self) -> list[Backend]:
        with self._lock:
            return list(self._by_name.values())

    def routable(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Backend]:
        """Healthy, not excluded, not saturated; raises ``NoBackend`` when none is."""
        now = time.monotonic()
        with self._lock:
            candidates = [b for b in self._by_name.values() if b.name not in exclude]
            healthy = [b for b in candidates if not b.ejected(now)]
            if not healthy:
                # other replicas' ejections steer, they never take this one down: with every
                # instance ejected by a share alone, route on this replica's own view
                healthy = [b for b in candidates if b.ejected_until <= now]
            ready = [b for b in healthy if b.in_flight < self.config.max_in_flight]
        if not healthy:
            raise NoBackend(False, "no healthy instance to route to")
        if not ready:
            raise NoBackend(True, "every instance is at router.max_in_flight")
        return sorted(ready, key=lambda b: b.name)

    def eject(self, backend: Backend, reason: str) -> bool:
        """Keep ``backend`` out for ``eject_s``. Returns whether it was in."""
        with self._lock:
            was_in = backend.ejected_until <= time.monotonic()
            backend.ejected_until = time.monotonic() + self.config.eject_s
            backend.ejected_reason = reason
        if was_in:
            log.warning(
                "router: ejected %s for %.0f s: %s", backend.name, self.config.eject_s, reason
            )
        return was_in

    def set_peer_view(self, view: dict[str, PeerView]) -> None:
        """What the other replicas share, by instance (an instance missing: nothing)."""
        with self._lock:
            for name, backend in self._by_name.items():
                backend.peer = view.get(name) or PeerView()

    def admit(self, backend: Backend) -> None:
        with self._lock:
            backend.ejected_until = 0.0
            backend.ejected_reason = ""

    # -- the router's own load accounting ----------------------------------------------------

    def dispatched(self, backend: Backend, prompt_tokens: int) -> None:
        with self._lock:
            backend.pending_prefill_tokens += prompt_tokens
            backend.in_flight += 1

    def first_token(self, backend: Backend, prompt_tokens: int) -> None:
        with self._lock:
            backend.pending_prefill_tokens = max(
                0.0, backend.pending_prefill_tokens - prompt_tokens
            )

    def finished(self, backend: Backend, prompt_tokens: int, got_first_token: bool) -> None:
        with self._lock:
            if not got_first_token:
                backend.pending_prefill_tokens = max(
                    0.0, backend.pending_prefill_tokens - prompt_tokens
                )
            backend.in_flight = max(0, backend.in_flight - 1)

    def scraped(self, backend: Backend, running: int, waiting: int, kv_usage: float) -> None:
        with self._lock:
            backend.scraped_running, backend.scraped_waiting = running, waiting
            backend.kv_usage = kv_usage
