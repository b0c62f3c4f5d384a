"""Which instances announced to the index the router may send prompts to.

An announcement is a ``Register`` call, which any ``engine`` credential may make
(docs/security.md), naming any API URL: whoever holds one tenant's engine token could point
the router at a server of their own and receive every tenant's prompts. Until the index
records who announced each location and the router can check it, an announcement is a hint,
not a trust decision: the router admits an announced instance only when its API URL's
host:port matches ``router.discover_allow`` (the operator's statement of where instances
run). Instances listed in ``router.backends`` are the operator's own and always admitted.

Unset ``discover_allow``: an anonymous deployment (no credentials, no token, no TLS: every
service on loopback, as ``make run`` runs) admits loopback URLs — there, anyone who can
announce can also reach every service directly, so the allow-list would protect nothing —
and any other deployment admits none until the operator lists where its instances run.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.core.config.auth import AuthConfig
from kvtier.core.config.router import LOOPBACK_PATTERNS, HostPattern, RouterConfig, url_host_port

log = logging.getLogger(__name__)

REMEMBERED_REFUSALS = 4096  # (location, URL) pairs logged already: bounded, announcers are many


def is_anonymous(auth: AuthConfig) -> bool:
    """No credential accepted, none presented, no TLS: an all-loopback deployment."""
    return not auth.enabled and auth.client_token() is None and not auth.tls.enabled


class DiscoveryPolicy:
    """Decides each announced API URL once per (location, URL); a refusal is logged once and
    reported through ``on_refused`` (the router's metric)."""

    def __init__(
        self,
        patterns: Sequence[HostPattern],
        source: str,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        """``source``: where ``patterns`` came from, for log lines."""
        self.patterns = tuple(patterns)
        self.source = source
        self.on_refused = on_refused
        self._refused: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        config: RouterConfig,
        anonymous: bool,
        on_refused: Callable[[], None] | None = None,
    ) -> DiscoveryPolicy:
        """``anonymous``: the deployment has no credentials anywhere (``is_anonymous``)."""
        patterns = config.allow_patterns()
        if patterns is not None:
            return cls(patterns, "router.discover_allow", on_refused)
        if anonymous:
            loopback = [HostPattern.parse(p) for p in LOOPBACK_PATTERNS]
            return cls(loopback, "loopback (anonymous deployment)", on_refused)
        return cls((), "router.discover_allow (unset, credentials configured)", on_refused)

    def warn_if_closed(self, config: RouterConfig) -> None:
        """At start: say so when discovery is on but can admit nothing."""
        if config.discover and not self.patterns:
            log.warning(
                "router: instances announced to the index are not routed to: credentials "
                "are configured and router.discover_allow is unset (any engine credential "
                "can announce any URL). List where your instances run in "
                "router.discover_allow, or list them in router.backends"
            )

    def admits(self, url: str) -> bool:
        where = url_host_port(url)
        return where is not None and any(p.admits(*where) for p in self.patterns)

    def check(self, location: str, url: str) -> bool:
        """Whether ``location``'s announced ``url`` may be routed to; a refusal is logged and
        counted once per (location, URL)."""
        if self.admits(url):
            return True
        with self._lock:
            first = (location, url) not in self._refused
            self._refused[(location, url)] = None
            self._refused.move_to_end((location, url))
            if len(self._refused) > REMEMBERED_REFUSALS:
                self._refused.popitem(last=False)
        if first:
            log.warning(
                "router: refusing instance %s announced at %s: not admitted by %s",
                location,
                url,
                self.source,
            )
            if self.on_refused is not None:
                self.on_refused()
        return False
