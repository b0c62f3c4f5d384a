"""Clients of a node store, importable without the server's dependencies (no FastAPI, uvicorn
or gRPC server): the gRPC client, the wire codec, shared-memory mapping, and ``connect``."""

from __future__ import annotations

from kvtier.core.config.store import StoreConfig
from kvtier.core.rpc import ClientAuth
from kvtier.store.api import StoreClient


def connect(
    config: StoreConfig,
    timeout_s: float = 10.0,
    lazy: bool = False,
    auth: ClientAuth | None = None,
) -> StoreClient:
    """The node store at ``config.address`` (``host:port`` or ``unix:/path``), or an embedded
    one (in this process) when no address is configured. ``timeout_s`` bounds each call to a
    served store; ``lazy`` tolerates one that is not up yet (calls answer UNAVAILABLE until it
    is); ``auth``: the token / TLS presented to a served store."""
    if config.address:
        from kvtier.store.client.grpc import GrpcStoreClient

        return GrpcStoreClient(
            config.address,
            timeout_s,
            lazy=lazy,
            auth=auth,
            fast_control=config.fast_control,
            view_leases=config.view_leases,
        )
    from kvtier.store.node import NodeStore  # embedded: the store itself, in this process

    return NodeStore(config)
