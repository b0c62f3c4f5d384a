"""Keep a location known to the index: register it, and again whenever the index forgot it.

Node stores announce themselves (``kvtier store serve --index``), and so do vLLM instances
through the connector when they publish KV events: the index then follows their events without
being configured with every source. The index may start after them or restart (an in-memory
backend forgets): the announcer checks every ``interval_s`` and registers again when needed.

Threading: one daemon thread per announcer.
"""

from __future__ import annotations

import logging
import threading

from kvtier.index.api import Registration
from kvtier.keys import Namespace
from kvtier.rpc import ClientAuth

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
        while not self._stop.is_set():
            try:
                client = client or GrpcIndexClient(self.index_address, auth=self.auth)
                if name not in {i.registration.location for i in client.locations()}:
                    for namespace in self.namespaces:  # definitions: token queries need them
                        client.register_namespace(namespace)
                    client.register(self.registration)
                    log.info("announced %s to the index at %s", name, self.index_address)
                self.registered.set()
            except Exception as exc:
                log.debug("announcing %s to %s failed: %s", name, self.index_address, exc)
            self._stop.wait(self.interval_s)
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._stop.set()
