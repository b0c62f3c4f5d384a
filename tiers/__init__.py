"""The media behind one interface (``base.py``): the node's DRAM pool (``cpu.py``), other
nodes' pools (``remote.py``); vLLM's own GPU memory is vLLM's. ``connect`` opens the pool,
``open_tiers`` everything a vLLM instance's config asks for."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.core.config import KvtierConfig
from kvtier.core.config.store import StoreConfig
from kvtier.core.rpc import ClientAuth
from kvtier.store.api import StoreAdmin
from kvtier.store.client import connect as connect_store
from kvtier.tiers.base import PoolTier, StagingTier
from kvtier.tiers.cpu import CpuTier

__all__ = ["CpuTier", "PoolTier", "StagingTier", "Tiers", "connect", "open_tiers"]


def connect(
    config: StoreConfig,
    timeout_s: float = 10.0,
    max_namespaces: int = 4096,
    lazy: bool = False,
    auth: ClientAuth | None = None,
) -> CpuTier:
    """The node's DRAM tier: the store at ``config.address``, or an embedded one (in this
    process) when no address is configured. ``timeout_s`` bounds each control call to a
    served store; ``lazy`` tolerates a store that is not up yet; ``auth``: what to present."""
    store = connect_store(config, timeout_s, lazy=lazy, auth=auth)
    segment = store.local_segment()
    # An embedded store is this process's own: the tier may clear it (a shared one is cleared
    # by its operator, never by an engine).
    admin = store if segment is not None and isinstance(store, StoreAdmin) else None
    return CpuTier(store, segment=segment, max_namespaces=max_namespaces, admin=admin)


@dataclass
class Tiers:
    """What one vLLM instance reads from: the node pool, then the staging tiers in order."""

    pool: PoolTier
    staging: list[StagingTier] = field(default_factory=list)

    @property
    def embedded(self) -> bool:
        """The pool's store runs in this process (its calls answer in microseconds)."""
        return self.pool.embedded

    def close(self) -> None:
        for tier in self.staging:
            tier.close()
        self.pool.close()


def open_tiers(config: KvtierConfig, lazy: bool = True) -> Tiers:
    """The tiers ``config.connector.tiers`` names, staging tiers in the order listed ("cpu"
    always comes first: every load reads the node pool; "disk" stages the node's disk into
    it; "remote" stages other nodes' chunks into it through the index)."""
    connector = config.connector
    auth = ClientAuth.from_config(config.auth)
    pool = connect(
        config.store,
        connector.store_timeout_s,
        connector.namespace_cache_size,
        lazy=lazy,
        auth=auth,
    )
    tiers = Tiers(pool)
    for name in connector.tiers:
        if name == "disk":
            from kvtier.core.costs import KappaTable
            from kvtier.tiers.disk import DiskTier

            costs = KappaTable.from_file(connector.kappa_file) if connector.kappa_file else None
            tiers.staging.append(
                DiskTier(pool, connector.disk_timeout_s, costs, connector.chunk_tokens)
            )
        elif name == "remote":
            from kvtier.index.client import connect as connect_index
            from kvtier.tiers.remote import RemoteTier

            index = connect_index(config.index, auth)
            tiers.staging.append(RemoteTier(index, pool, connector.remote_fetch_timeout_s))
    return tiers
