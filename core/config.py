"""One typed configuration for every kvtier process.

Sources, lowest to highest precedence: defaults < config file (TOML) < environment < flags.

- file: ``--config PATH`` or ``KVTIER_CONFIG=PATH``; sections mirror the model
  (``[store]``, ``[store.pool]``, ...).
- environment: ``KVTIER_<SECTION>__<FIELD>``, e.g. ``KVTIER_STORE__POOL__CAPACITY=8GiB``. No
  other variables are read: the model is the list of settings.
- flags: each CLI command maps its options onto fields of this model.

Defaults work on one machine with nothing else running.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvtier.connector.config import ConnectorConfig
from kvtier.index.config import IndexConfig
from kvtier.tiers.remote.config import RemoteConfig

EvictionPolicyName = Literal["lru", "s3fifo"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PoolConfig(_Section):
    """The node's shared-memory DRAM pool."""

    capacity: ByteSize = Field(ByteSize(1 << 30), description="bytes of KV the pool holds")
    page_size: ByteSize = Field(
        ByteSize(64 << 10),
        description="allocation unit; a chunk takes whole pages, not necessarily contiguous",
    )
    eviction: EvictionPolicyName = "s3fifo"
    prefault: bool = Field(True, description="touch every page at start so no put page-faults")

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.page_size < 4096 or self.page_size & (self.page_size - 1):
            raise ValueError("pool.page_size must be a power of two >= 4096")
        if self.capacity < self.page_size:
            raise ValueError("pool.capacity must hold at least one page")
        return self


class StoreConfig(_Section):
    """The per-node store service (and the client's view of it)."""

    node_id: str = Field(default_factory=socket.gethostname, description="identity in events")
    address: str | None = Field(
        None, description="client side: host:port of a running store; unset = embedded store"
    )
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(50551, ge=0, le=65535)
    http_host: str = "127.0.0.1"
    http_port: int = Field(50552, ge=0, le=65535)
    run_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "kvtier-run",
        description="lock files that tell a restart what a crashed store left behind",
    )
    lease_ttl_s: float = Field(30.0, gt=0, description="read lease lifetime")
    write_ttl_s: float = Field(60.0, gt=0, description="allocate-to-commit deadline")
    max_lease_ttl_s: float = Field(600.0, gt=0)
    event_buffer: int = Field(
        65536, ge=16, description="event batches kept for subscribers that fall behind"
    )
    grpc_workers: int = Field(16, ge=2)
    index_address: str | None = Field(
        None, description="announce this store to the index there (it then follows its events)"
    )
    advertise_address: str | None = Field(
        None,
        description="host:port other nodes and the index reach this store's gRPC API at "
        "(default: the bound address, or remote.hostname when bound to all interfaces)",
    )
    pool: PoolConfig = Field(default_factory=PoolConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)


class KvtierConfig(BaseSettings):
    """Root of the configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix="KVTIER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    store: StoreConfig = Field(default_factory=StoreConfig)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: flags (init kwargs) > environment > file.
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _CONFIG_FILE.get("path")
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


# Set only for the duration of load_config(); pydantic-settings reads sources at construction.
_CONFIG_FILE: dict[str, Path | None] = {}


def load_config(file: str | Path | None = None, **flags: Any) -> KvtierConfig:
    """Build the configuration from file, environment and flags.

    ``flags`` are nested dicts or dotted names: ``load_config(**{"store.grpc_port": 0})``.
    ``None`` flag values mean "not given" and are dropped, so CLI options can default to None.
    """
    path = file if file is not None else os.environ.get("KVTIER_CONFIG")
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    nested: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        node = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    _CONFIG_FILE["path"] = Path(path) if path is not None else None
    try:
        return _merge_with_sources(nested)
    finally:
        _CONFIG_FILE.clear()


def _merge_with_sources(flags: dict[str, Any]) -> KvtierConfig:
    # pydantic-settings merges nested sections of init kwargs over env/file section by section,
    # so a flag for store.grpc_port keeps store.pool from the file.
    return KvtierConfig(**flags)
