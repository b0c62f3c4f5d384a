"""Clients of the index, importable without the server's dependencies: the gRPC client, the
wire codec, the announcer (how a store or vLLM instance makes the index follow it), and
``connect``."""

from __future__ import annotations

from kvtier.core.config.index import IndexConfig
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import ChunkIndex


def connect(config: IndexConfig, auth: ClientAuth | None = None) -> ChunkIndex:
    """The index at ``config.address`` (presenting ``auth``), or an embedded one (in this
    process)."""
    if config.address:
        from kvtier.index.client.grpc import GrpcIndexClient

        return GrpcIndexClient(config.address, auth=auth)
    from kvtier.index.server.service import EmbeddedIndex  # embedded: the index itself, here

    return EmbeddedIndex(config)
