"""Which peer stores this store may dial: the ones it was configured with
(``store.remote.peers``) and the node stores the index lists (a NODE location's ``store``
endpoint, which only a node credential may register). Nothing else.

Why: ``Fetch`` names the holder to pull from, and whoever calls it (an engine, with one
tenant's credential) could name any address. Dialing it would present this store's node
token there (whose holder may then read and delete every tenant's chunks), and the answers
for an open and a closed port would differ (a port scanner through the store). So a holder
this directory does not list is refused before any connection is made, with one answer for
every such address (``PeerClients``), and a listed peer still proves a node credential
before the token is sent (``GrpcStoreClient(verify=...)``).

The holders a connector passes come from the index's answers, so the index is the list to
follow: re-read every ``refresh_s`` in the background, and at once (at most every
``MISS_REFRESH_S``) when a fetch names an address not listed yet (a store that just
announced itself).

Threading: thread-safe; one daemon thread while started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from kvtier.core.errors import KvtierError
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import LocationKind

log = logging.getLogger(__name__)

MISS_REFRESH_S = 1.0  # an unlisted holder re-reads the index at most this often


class PeerDirectory:
    def __init__(
        self,
        configured: Iterable[str] = (),
        source: Callable[[], Iterable[str]] | None = None,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``configured``: peers trusted from the configuration. ``source``: the peers the
        index lists now (raises KvtierError when it cannot say); None: configured only."""
        self._configured = frozenset(a for a in configured if a)
        self._source = source
        self.refresh_s = refresh_s
        self._clock = clock
        self._listed: frozenset[str] = frozenset()
        self._tried_at = -float("inf")  # the last attempt to read ``source``
        self._refresh_lock = threading.Lock()  # one reader of the source at a time
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def known(self, address: str) -> bool:
        """Whether this store may dial ``address`` (exactly as listed: never resolved)."""
        if address in self._configured or address in self._listed:
            return True
        if self._source is None or self._clock() - self._tried_at < MISS_REFRESH_S:
            return False
        self.refresh(min_age_s=MISS_REFRESH_S)
        return address in self._listed

    def addresses(self) -> frozenset[str]:
        return self._configured | self._listed

    def refresh(self, min_age_s: float = 0.0) -> None:
        """Re-read the index's list (unless another thread did within ``min_age_s``). On
        failure the last list is kept: a peer does not stop being one because the index
        did not answer."""
        if self._source is None:
            return
        with self._refresh_lock:
            if self._clock() - self._tried_at < min_age_s:
                return  # another caller just did
            self._tried_at = self._clock()
            try:
                self._listed = frozenset(a for a in self._source() if a)
            except KvtierError as exc:
                log.debug("cannot list peer stores at the index: %s", exc)

    def start(self) -> None:
        if self._source is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvtier-peers", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            self.refresh(min_age_s=MISS_REFRESH_S)
            if self._closed.wait(self.refresh_s):
                return

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


class IndexPeers:
    """The ``store`` endpoints of the NODE locations the index lists: a ``PeerDirectory``
    source. The index is configured (``index.address``), so this store presents its own
    credential there, as it does to announce itself."""

    def __init__(self, index_address: str, auth: ClientAuth | None, timeout_s: float) -> None:
        from kvtier.index.client.grpc import GrpcIndexClient

        self._client = GrpcIndexClient(index_address, timeout_s, auth)

    def __call__(self) -> list[str]:
        return [
            info.registration.endpoints["store"]
            for info in self._client.locations()
            if info.registration.kind is LocationKind.NODE
            and info.registration.endpoints.get("store")
        ]

    def close(self) -> None:
        self._client.close()
