"""Settings of the remote tier: the ``[store.remote]`` section of the one config model.

Every knob the Mooncake transfer engine reads from ``MC_*`` environment variables is a field
here; ``kvtier.tiers.remote.mooncake`` writes them into the environment just before it builds
the engine (see docs/remote.md for why each one matters), so nobody sets ``MC_*`` by hand.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

Protocol = Literal["tcp", "rdma"]
DemotionPolicy = Literal["none", "peers"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DemotionConfig(_Section):
    """Push cold chunks to a peer store with room instead of evicting them."""

    policy: DemotionPolicy = Field(
        "none", description="none: evict as usual; peers: move cold chunks to remote.peers"
    )
    high_watermark: float = Field(
        0.9, gt=0, le=1, description="start demoting when the pool is fuller than this"
    )
    low_watermark: float = Field(0.8, ge=0, lt=1, description="demote until this full")
    interval_s: float = Field(1.0, gt=0, description="how often the pool's fill is checked")
    max_batch_bytes: ByteSize = Field(
        ByteSize(256 << 20), description="at most this much moved per peer fetch"
    )

    @model_validator(mode="after")
    def _check(self) -> DemotionConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError("demotion.low_watermark must be below demotion.high_watermark")
        return self


class RemoteConfig(_Section):
    """Node stores serving each other's pools over the Mooncake transfer engine."""

    enabled: bool = Field(
        False, description="register the pool with a transfer engine and serve/fetch peers"
    )
    protocol: Protocol = Field(
        "tcp", description="rdma in production; tcp on loopback and in CI (MC_FORCE_TCP)"
    )
    device_name: str = Field(
        "", description="RDMA devices (comma-separated HCA names); empty = all / not used"
    )
    metadata: str = Field(
        "P2PHANDSHAKE",
        description="P2PHANDSHAKE (no service), or http://host:port/metadata, etcd://host:port",
    )
    hostname: str = Field(
        "127.0.0.1",
        description="address peers reach this node at (transfer engine and advertised gRPC)",
    )
    min_port: int = Field(15000, ge=1024, le=65535, description="engine ports (MC_MIN_RPC_PORT)")
    max_port: int = Field(17000, ge=1024, le=65535, description="engine ports (MC_MAX_RPC_PORT)")
    fetch_timeout_s: float = Field(
        2.0, gt=0, description="a fetch (lease at the holder, transfer, commit) ends by then"
    )
    rpc_timeout_s: float = Field(1.0, gt=0, description="each control call to a peer store")
    probe_timeout_s: float = Field(
        0.5, gt=0, description="first contact with a peer: liveness probe deadline"
    )
    transfer_timeout_s: int = Field(
        5, ge=5, description="engine deadline of one transfer (MC_TRANSFER_TIMEOUT, min 5)"
    )
    tcp_progress_timeout_s: int = Field(
        3,
        ge=1,
        description="engine drops a TCP transfer without progress this long "
        "(MC_TCP_PROGRESS_TIMEOUT_SEC, MC_TCP_STATUS_TIMEOUT_SEC); < transfer_timeout_s",
    )
    quarantine_s: float = Field(
        10.0,
        gt=0,
        description="pages a failed transfer was writing stay unused this long (late bytes); "
        "> transfer_timeout_s",
    )
    log_level: Literal["TRACE", "INFO", "WARNING", "ERROR"] = Field(
        "ERROR", description="engine log level (MC_LOG_LEVEL)"
    )
    peers: list[str] = Field(
        default_factory=list, description="gRPC host:port of peer stores (demotion targets)"
    )
    demotion: DemotionConfig = Field(default_factory=DemotionConfig)

    @model_validator(mode="after")
    def _check(self) -> RemoteConfig:
        if self.min_port > self.max_port:
            raise ValueError("remote.min_port must not exceed remote.max_port")
        if self.tcp_progress_timeout_s >= self.transfer_timeout_s:
            # Otherwise a stalled socket outlives the engine's own deadline and its bytes may
            # land after the transfer was reported failed.
            raise ValueError("remote.tcp_progress_timeout_s must be below transfer_timeout_s")
        if self.quarantine_s <= self.transfer_timeout_s:
            raise ValueError("remote.quarantine_s must exceed remote.transfer_timeout_s")
        if self.demotion.policy == "peers" and not (self.peers and self.enabled):
            raise ValueError("remote.demotion.policy = 'peers' needs remote.enabled and peers")
        meta = self.metadata
        if not (meta == "P2PHANDSHAKE" or meta.startswith(("http://", "etcd://"))):
            # The engine aborts the whole process on a metadata plugin it was built without
            # (redis in the wheels we use): refuse it here with a message instead.
            raise ValueError(
                f"remote.metadata {meta!r}: use P2PHANDSHAKE, http://host:port/path or "
                "etcd://host:port"
            )
        return self
