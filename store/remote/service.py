"""The remote tier of one node store: its transfer engine, peer clients, fetcher and demoter.

``NodeStore`` builds one when ``store.remote.enabled``; a fetch and a peer's lease go to its
``fetcher`` (``kvtier.store.remote.fetch``), the remote stats come from here. Shutdown order
matters: the demoter first (it calls peers), then the pool's registration (so no peer reads
memory about to be unmapped).

Threading: thread-safe.
"""

from __future__ import annotations

import socket

from kvtier.core.auth import Authenticator
from kvtier.core.config.store import RemoteConfig
from kvtier.core.rpc import ClientAuth
from kvtier.store.client.shm import SharedSegment
from kvtier.store.remote.demotion import Demoter
from kvtier.store.remote.directory import IndexPeers, PeerDirectory
from kvtier.store.remote.fetch import Fetcher
from kvtier.store.remote.peers import PeerClients
from kvtier.store.remote.transport import Transport
from kvtier.store.state.core import StoreCore


def make_transport(config: RemoteConfig) -> Transport:
    from kvtier.store.remote.mooncake import MooncakeTransport

    name = ""
    if config.metadata != "P2PHANDSHAKE":
        # With a metadata service the engine is known by this name: make it unique per store.
        with socket.socket() as s:
            s.bind((config.hostname, 0))
            name = f"{config.hostname}:{s.getsockname()[1]}"
    return MooncakeTransport(config, segment_name=name)


class RemoteTier:
    def __init__(
        self,
        core: StoreCore,
        segment: SharedSegment,
        config: RemoteConfig,
        transport: Transport | None = None,
        peer_auth: ClientAuth | None = None,
        peer_verify: Authenticator | None = None,
        index_address: str | None = None,
    ) -> None:
        """``peer_auth``: what this store presents to its peers; ``peer_verify``: checks
        their proof of a node credential first (``PeerClients``). ``index_address``: the
        index whose node stores are peers too, besides ``config.peers`` (``PeerDirectory``)."""
        self.config = config
        self.transport = transport or make_transport(config)
        try:
            self.transport.register_pool(segment.base_address, segment.size)
        except BaseException:
            self.transport.close()
            raise
        self.base_address = segment.base_address
        source = None
        if index_address:
            source = IndexPeers(index_address, peer_auth, config.rpc_timeout_s)
        self.directory = PeerDirectory(config.peers, source, config.peer_refresh_s)
        self.peers = PeerClients(config.rpc_timeout_s, peer_auth, peer_verify, self.directory)
        self.fetcher = Fetcher(core, segment, self.transport, config, self.peers)
        self.core = core
        self.demoter: Demoter | None = None
        self.directory.start()

    @property
    def address(self) -> str:
        return self.transport.address

    def start_demotion(self, self_address: str) -> None:
        """Start demoting to ``remote.peers`` (if the policy says so); ``self_address`` is the
        gRPC address peers fetch from."""
        if self.config.demotion.policy == "peers" and self.demoter is None:
            self.demoter = Demoter(self.core, self.config, self.peers, self_address)
            self.demoter.start()

    def stats(self) -> dict[str, int]:
        out = self.fetcher.stats()
        out["remote_inflight_ops"] = int(getattr(self.transport, "inflight_ops", 0))
        counters = self.demoter.counters if self.demoter else {}
        for name in ("demoted_chunks", "demoted_bytes", "demotion_failures"):
            out[f"remote_{name}"] = counters.get(name, 0)
        return out

    def close(self) -> None:
        if self.demoter is not None:
            self.demoter.stop()
        self.fetcher.close()
        self.transport.close()
        self.peers.close()
        self.directory.close()
