"""``[store]``: the node store, its DRAM pool (``[store.pool]``), its remote tier
(``[store.remote]``) and its local disk tier (``[store.disk]``).

Every knob the Mooncake transfer engine reads from ``MC_*`` environment variables is a field
of ``RemoteConfig``; ``kvtier.store.remote.mooncake`` writes them into the environment just
before it builds the engine (see docs/remote.md for why each one matters), so nobody sets
``MC_*`` by hand.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, SecretStr, model_validator

from kvtier.core.config.section import Section

Protocol = Literal["tcp", "rdma"]
DemotionPolicy = Literal["none", "peers"]


class DemotionConfig(Section):
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


class RemoteConfig(Section):
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
        default_factory=list,
        description="gRPC host:port of peer stores: besides the node stores the index lists "
        "(index.address), the only holders a fetch may pull from (each proves a node "
        "credential first), and the demotion targets. Written exactly as fetches name them "
        "(no name resolution when comparing)",
    )
    peer_refresh_s: float = Field(
        10.0,
        gt=0,
        description="how often the node stores the index lists are re-read (and at most once "
        "a second when a fetch names a holder not listed yet)",
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


class DiskConfig(Section):
    """The node's local disk tier: cold chunks of the DRAM pool copied to files before
    eviction takes them, staged back into the pool on a hit (docs/disk.md)."""

    enabled: bool = Field(False, description="keep a copy of cold chunks on local disk")
    path: Path | None = Field(
        None,
        description="directory of the chunk files (created 0700; survives store restarts, so "
        "put it on the NVMe, not under run_dir's tmpfs)",
    )
    capacity: ByteSize = Field(
        ByteSize(16 << 30), description="bytes of chunk files kept (least recently used go)"
    )
    high_watermark: float = Field(
        0.75,
        gt=0,
        le=1,
        description="copy the pool's coldest chunks to disk while it is fuller than this "
        "(what eviction takes next is then already on disk)",
    )
    write_through: bool = Field(
        False,
        description="copy every committed chunk to disk, whatever the pool's fill (a restart "
        "then finds the whole pool on disk; costs a write per chunk stored)",
    )
    interval_s: float = Field(
        0.05, gt=0, description="how often the pool's fill is checked (a cheap check)"
    )
    max_batch_bytes: ByteSize = Field(
        ByteSize(64 << 20), description="at most this much written per round"
    )
    max_pool_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="a round pins at most this fraction of the pool while it copies (at least "
        "one chunk), so saves can still evict the rest: max_batch_bytes alone could pin most "
        "of a small pool",
    )
    read_threads: int = Field(4, ge=1, le=64, description="files read at once by one stage")
    fsync: bool = Field(
        True,
        description="fsync each chunk file before it is visible (a chunk then survives a "
        "power loss, not only a store crash); off only for disposable benchmarks",
    )
    default_quota: ByteSize | None = Field(
        None,
        description="most bytes of chunk files each tenant not in store.tenants may hold (one "
        "cap per cache_salt, as store.default_quota is for the pool); None = no cap",
    )

    @model_validator(mode="after")
    def _check(self) -> DiskConfig:
        if self.enabled and self.path is None:
            raise ValueError("store.disk.enabled needs store.disk.path")
        return self


EvictionPolicyName = Literal["lru", "s3fifo"]


class PoolConfig(Section):
    """The node's shared-memory DRAM pool."""

    capacity: ByteSize = Field(ByteSize(1 << 30), description="bytes of KV the pool holds")
    page_size: ByteSize = Field(
        ByteSize(64 << 10),
        description="allocation unit; a chunk takes whole pages, not necessarily contiguous",
    )
    eviction: EvictionPolicyName = Field(
        "s3fifo", description="which chunks a full pool evicts first: lru or s3fifo"
    )
    prefault: bool = Field(True, description="touch every page at start so no put page-faults")

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.page_size < 4096 or self.page_size & (self.page_size - 1):
            raise ValueError("pool.page_size must be a power of two >= 4096")
        if self.capacity < self.page_size:
            raise ValueError("pool.capacity must hold at least one page")
        return self


class TenantQuota(Section):
    """A tenant (the requests carrying one of ``cache_salts``): how much of the pool it may
    hold, and how much of it no other tenant's allocation may evict."""

    name: str = Field(description="shows in stats and metrics (never the salts)")
    cache_salts: list[SecretStr] = Field(description="the tenant's cache_salt values")
    quota: ByteSize | None = Field(None, description="most bytes it may hold; None = no cap")
    floor: ByteSize = Field(
        ByteSize(0), description="bytes of it never evicted for another tenant's allocation"
    )
    disk_quota: ByteSize | None = Field(
        None, description="most bytes of chunk files it may hold on the disk tier; None = no cap"
    )
    disk_floor: ByteSize = Field(
        ByteSize(0),
        description="bytes of its chunk files never removed for another tenant's (disk tier)",
    )


def default_run_dir() -> Path:
    """Private to this uid: $XDG_RUNTIME_DIR/kvtier (per-user, on tmpfs), else
    ~/.cache/kvtier/run. Never a fixed shared /tmp path, where another user could plant the
    lock files that tell a starting store which segments to remove."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_absolute():
        return Path(runtime) / "kvtier"
    try:
        return Path.home() / ".cache" / "kvtier" / "run"
    except (RuntimeError, KeyError):  # no home (an arbitrary container uid): still per-uid
        return Path(tempfile.gettempdir()) / f"kvtier-run-{os.getuid()}"


class StoreConfig(Section):
    """The per-node store service (and the client's view of it)."""

    node_id: str = Field(
        default_factory=socket.gethostname,
        description="identity in events",
        json_schema_extra={"default_doc": "this host's name"},
    )
    address: str | None = Field(
        None, description="client side: host:port of a running store; unset = embedded store"
    )
    grpc_host: str = Field("127.0.0.1", description="address the gRPC control API binds")
    grpc_port: int = Field(50551, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_host: str = Field(
        "127.0.0.1", description="address the HTTP API (health, metrics, stats) binds"
    )
    http_port: int = Field(50552, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    unix_socket: Path | None = Field(
        None,
        description="also serve the control API on this Unix socket (its directory is made "
        "0700): the node's engines connect to unix:<path> with no token and no network",
    )
    fast_control: bool = Field(
        True,
        description="the engine hot path (lookup, allocate, commit, abort, release, renew) "
        "over a framed Unix socket in run_dir instead of gRPC (~20x cheaper a call; "
        "docs/benchmarks.md). Store side: serve it; engine side: use it when the store does",
    )
    view_leases: bool = Field(
        True,
        description="with fast_control: engines lease pool hits themselves (a pin in shared "
        "memory the store honours, no call: kvtier.store.client.view_leases). Store side: "
        "keep the lease region; engine side: use it when the store does. Off: a call each",
    )
    view_lease_sessions: int = Field(
        64,
        ge=1,
        le=4096,
        description="client sessions that get a row of pins (one per engine process); the "
        "rest lease through calls",
    )
    view_lease_pins: int = Field(
        2048,
        ge=16,
        le=1 << 20,
        description="chunks one session may hold pinned at once (beyond: leased through calls)",
    )
    run_dir: Path = Field(
        default_factory=default_run_dir,
        description="lock files that tell a restart what a crashed store left behind; private "
        "to the store's uid (made 0700; refused when another uid owns it or others may write "
        "it). Default: $XDG_RUNTIME_DIR/kvtier, else ~/.cache/kvtier/run",
        json_schema_extra={"default_doc": "$XDG_RUNTIME_DIR/kvtier, else ~/.cache/kvtier/run"},
    )
    lease_ttl_s: float = Field(
        30.0,
        gt=0,
        description="read lease lifetime when the caller names none (a renew without a TTL, "
        "a peer's pull); told to clients in the store's info",
    )
    write_ttl_s: float = Field(60.0, gt=0, description="allocate-to-commit deadline")
    max_lease_ttl_s: float = Field(
        600.0, gt=0, description="the longest TTL one lease is granted, whatever was asked"
    )
    max_lease_lifetime_s: float = Field(
        600.0,
        gt=0,
        description="a lease's whole life, renewals included: renew shortens the last TTL to "
        "it, then answers LEASE_EXPIRED (a client cannot pin chunks forever)",
    )
    session_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a client session without a heartbeat this long ends, releasing its "
        "leases (a killed engine frees its pins in seconds, not at lease expiry)",
    )
    max_sessions: int = Field(65536, ge=1, description="open client sessions at most")
    max_leases_per_session: int = Field(
        16384,
        ge=1,
        description="leases (read and write) one client session holds at once; one more is "
        "refused with LIMIT_EXCEEDED until it releases some. Each costs the store memory. "
        "A vLLM connector holds about two per running request and TP rank (its lookup and a "
        "staging lookup): the default covers 1024 sequences at TP 8. Leases over gRPC "
        "always belong to a session (a lease asked for without one is refused)",
    )
    max_leased_chunks_per_session: int = Field(
        1 << 20,
        ge=1,
        description="chunks one client session holds under its leases at once (a chunk "
        "pinned by two leases counts twice; ~8 bytes of store memory each); past it a lookup "
        "that would lease, or an allocate, is refused with LIMIT_EXCEEDED. The default "
        "covers 256 sequences of 128k-token prompts (512 chunks of 256 tokens) at TP 8",
    )
    max_batch_keys: int = Field(
        16384,
        ge=1,
        description="most keys (or lease ids) in one lookup, allocate, commit, abort, delete, "
        "release, lease_for_peer or fetch; a larger batch is refused before it takes the "
        "store's lock, which one request may otherwise hold for seconds",
    )
    max_batch_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="one allocate may not ask for more than this fraction of the pool unless "
        "it fits in free space: such a batch is refused (LIMIT_EXCEEDED) and evicts nothing, "
        "so no single request can flush the pool",
    )
    max_namespaces: int = Field(
        4096,
        ge=1,
        description="registered namespaces at most (re-registering a known one always works)",
    )
    event_buffer: int = Field(
        65536, ge=16, description="event batches kept for subscribers that fall behind"
    )
    grpc_workers: int = Field(16, ge=2, description="threads serving gRPC calls")
    index_address: str | None = Field(
        None, description="deprecated: set index.address (the store announces itself there)"
    )
    advertise_address: str | None = Field(
        None,
        description="host:port other nodes and the index reach this store's gRPC API at "
        "(default: the bound address, or remote.hostname when bound to all interfaces)",
    )
    max_message_bytes: ByteSize = Field(
        ByteSize(64 << 20), description="largest gRPC message (a batch of keys, a snapshot)"
    )
    tenants: list[TenantQuota] = Field(
        default_factory=list, description="per-tenant quotas and floors (docs/security.md)"
    )
    default_quota: ByteSize | None = Field(
        None,
        description="most bytes each tenant not in `tenants` may hold (one cap per cache_salt, "
        "unsalted requests being one tenant); None = no cap",
    )
    pool: PoolConfig = Field(default_factory=PoolConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)

    @model_validator(mode="after")
    def _disk_holds_the_pool(self) -> StoreConfig:
        if self.disk.enabled and self.disk.capacity < self.pool.capacity:
            # A disk that drops chunks the pool still holds would have them copied again at
            # the next round, and again: the spill thread would churn.
            raise ValueError(
                f"store.disk.capacity ({self.disk.capacity.human_readable()}) must be at least "
                f"store.pool.capacity ({self.pool.capacity.human_readable()})"
            )
        floors = sum(int(t.disk_floor) for t in self.tenants)
        if self.disk.enabled and floors > self.disk.capacity:
            raise ValueError(
                f"store.tenants: the disk floors add up to {ByteSize(floors).human_readable()}, "
                f"more than store.disk.capacity ({self.disk.capacity.human_readable()})"
            )
        return self
