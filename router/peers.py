"""Router replicas that agree: each shares what only it sees, and applies what the others see.

Every replica reads the same index (its replica of it) and the same engine metrics, but three
things each knows alone: the requests it has in flight on each instance (and their prompt
tokens not yet prefilled), the instances it ejected after a failure, and the prompts it just
routed (speculatively held: the engines' events lag a burst). Without sharing, three replicas
each see a third of an instance's queue, keep sending to an instance another just found
dead, and spread one burst of a prefix over cold instances.

So every ``router.share_interval_s`` (0.1 s) a replica sends its ``RouterShare`` to the index
(``Share``), which relays it to the other replicas through its change feed (not stored: valid
for ``router.share_ttl_s``). Each replica applies the others' fresh shares:

- **load**: an instance's in-flight requests and pending prefill tokens are its own plus the
  others' (``Backend.load``); the scraped engine metrics still bound them from below;
- **ejections**: an instance another replica ejected is not routable here either, for what
  is left of that ejection (``Backends.routable``);
- **speculative holdings**: prompts the others routed count as held on their instance's GPU
  for ``speculative_s``, as this replica's own do.

Given the same request and the same shared state, two replicas choose the same instance (the
policies are deterministic). A replica that dies stops sharing: its share lapses after
``share_ttl_s`` and the others route as before; a client's request that had not reached an
instance is retried to another replica by the client (tests/integration/test_router_replicas.py).
An index that keeps no feed answers ``UNSUPPORTED``: the replica says why once and routes on
its own view.

Threading: the sharing thread sends; shares arrive on the index replica's follower thread;
``routed`` is called by decision threads; one lock around the buffer and the peers' table.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.index.client.changes import InstanceShare, RouterShare
from kvtier.index.client.replica import IndexReplica
from kvtier.router.backends import Backends, PeerView

log = logging.getLogger(__name__)

MAX_ROUTED_KEYS = 1 << 15  # keys of routed prompts in one share (the rest are not shared)


def replica_name(configured: str = "") -> str:
    """This replica's name in its shares: the configured one, or host:pid, plus a random tag
    (a restarted replica is another one; the index prefixes the caller's credential)."""
    base = configured or f"{socket.gethostname()}:{os.getpid()}"
    return f"{base}:{secrets.token_hex(3)}"


class PeerShares:
    def __init__(
        self,
        name: str,
        backends: Backends,
        index: IndexReplica,
        record_speculative: Callable[[Sequence[bytes], str], None],
        interval_s: float = 0.1,
        ttl_s: float = 1.0,
        start: bool = True,
    ) -> None:
        self.name = name
        self.backends = backends
        self.index = index
        self.record_speculative = record_speculative
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.unsupported: str | None = None
        self.sent = self.received = 0
        self._routed: list[tuple[str, bytes, tuple[bytes, ...]]] = []
        self._routed_keys = 0
        self._peers: dict[str, tuple[RouterShare, float]] = {}  # router -> (share, received)
        self._last_instances: tuple[InstanceShare, ...] | None = None  # what was last sent
        self._last_sent = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        index.on_share = self.receive
        self._thread = threading.Thread(target=self._run, name="kvtier-router-share", daemon=True)
        if start:
            self._thread.start()

    # -- this replica's share ---------------------------------------------------------------

    def routed(self, instance: str, ns_id: bytes, keys: Sequence[bytes]) -> None:
        """A prompt this replica just sent to ``instance``: the others hear of it next share."""
        with self._lock:
            if self._routed_keys + len(keys) <= MAX_ROUTED_KEYS:
                self._routed.append((instance, ns_id, tuple(keys)))
                self._routed_keys += len(keys)

    def share_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            routed, self._routed, self._routed_keys = self._routed, [], 0
        instances = tuple(
            InstanceShare(
                b.name,
                b.in_flight,
                b.pending_prefill_tokens,
                max(0.0, b.ejected_until - now),
                b.ejected_reason[:200],
            )
            for b in self.backends.all()
        )
        # the same view again only as a keepalive, before its TTL ends (the feed carries every
        # share to every replica: an idle fleet's shares must not crowd its index's changes)
        same = not routed and instances == self._last_instances
        if not same or now - self._last_sent >= self.ttl_s / 2:
            self.index.share(RouterShare(self.name, self.ttl_s, instances, tuple(routed)))
            self._last_instances, self._last_sent = instances, now
            self.sent += 1
        self._apply()  # the others' lapsed shares leave the view even when none arrive

    # -- the others' shares -----------------------------------------------------------------

    def receive(self, share: RouterShare) -> None:
        if share.router.rpartition("/")[2] == self.name:
            return  # its own, back through the feed
        with self._lock:
            self._peers[share.router] = (share, time.monotonic())
            self.received += 1
        for instance, _ns_id, keys in share.routed:
            self.record_speculative(keys, instance)
        self._apply()

    def peers(self) -> list[str]:
        """The other replicas whose shares are fresh."""
        now = time.monotonic()
        with self._lock:
            return [r for r, (s, at) in self._peers.items() if now - at <= s.ttl_s]

    def _apply(self) -> None:
        now = time.monotonic()
        view: dict[str, PeerView] = {}
        with self._lock:
            for router, (share, at) in list(self._peers.items()):
                if now - at > share.ttl_s:
                    del self._peers[router]
                    continue
                for i in share.instances:
                    seen = view.setdefault(i.instance, PeerView())
                    seen.in_flight += i.in_flight
                    seen.pending_prefill_tokens += i.pending_prefill_tokens
                    if i.ejected_for_s > 0 and at + i.ejected_for_s > seen.ejected_until:
                        seen.ejected_until = at + i.ejected_for_s
                        seen.ejected_reason = f"{router}: {i.ejected_reason}"
        self.backends.set_peer_view(view)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.share_once()
            except KvtierError as exc:
                if exc.code is ErrorCode.UNSUPPORTED:
                    self.unsupported = exc.message
                    log.warning("kvtier router: replicas share nothing: %s", exc.message)
                    return
                log.info("kvtier router: sharing with the other replicas: %s", exc)
            except Exception:  # never let sharing take the router down
                log.exception("kvtier router: sharing with the other replicas failed")

    def state(self) -> dict[str, object]:
        return {
            "name": self.name,
            "peers": self.peers(),
            "sent": self.sent,
            "received": self.received,
            "unsupported": self.unsupported,
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
