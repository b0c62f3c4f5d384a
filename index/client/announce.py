"""Keep a location known to the index: register it, and again whenever the index forgot it.

Node stores announce themselves (``kvtier store serve --index``), and so do vLLM instances
through the connector when they publish KV events: the index then follows their events without
being configured with every source. The index may start after them or restart (an in-memory
backend forgets), drop the location for silence (it then stops following it), or hold another
registration under the name: the announcer checks every ``interval_s`` and registers again
when the location is missing, down, or not the one announced (kind, endpoints). A refusal
(the name is another credential's, a bound) is logged as a warning, once per kind of answer.

Threading: one daemon thread per announcer.
"""

from __future__ import annotations

import logging
import threading

from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import LocationInfo, LocationStatus, Registration

log = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        index_address: str,
        registration: Registration,
        namespaces: tuple[Namespace, ...] = (),
        interval_s: float = 15.0,
        auth: ClientAuth | None = None,
    ) -> None:
        self.index_address = index_address
        self.auth = auth
        self.registration = registration
        self.namespaces = namespaces
        self.interval_s = interval_s
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-announce", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvtier.index.client.grpc import GrpcIndexClient

        client = None
        name = self.registration.location
        refused = ""
        while not self._stop.is_set():
            try:
                client = client or GrpcIndexClient(self.index_address, auth=self.auth)
                info = next(
                    (i for i in client.locations() if i.registration.location == name), None
                )
                if not self._current(info):
                    for namespace in self.namespaces:  # definitions: token queries need them
                        client.register_namespace(namespace)
                    client.register(self.registration)
                    log.info("announced %s to the index at %s", name, self.index_address)
                self.registered.set()
                refused = ""
            except KvtierError as exc:
                level = logging.WARNING if exc.code.value != refused else logging.DEBUG
                log.log(level, "announcing %s to %s failed: %s", name, self.index_address, exc)
                refused = exc.code.value
            except Exception as exc:
                log.debug("announcing %s to %s failed: %s", name, self.index_address, exc)
            self._stop.wait(self.interval_s)
        if client is not None:
            client.close()

    def _current(self, info: LocationInfo | None) -> bool:
        """Does the index hold this announcement (up, same kind and endpoints)? Its
        namespaces may differ: the index adds those it learns from the location's events."""
        if info is None or info.status is not LocationStatus.UP:
            return False
        reg = info.registration
        return reg.kind is self.registration.kind and all(
            reg.endpoints.get(k) == v for k, v in self.registration.endpoints.items()
        )

    def stop(self) -> None:
        self._stop.set()
