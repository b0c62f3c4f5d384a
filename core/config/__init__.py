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
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvtier.core.config.auth import AuthConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.core.config.index import IndexConfig, StoreSource, VllmSource
from kvtier.core.config.router import BackendConfig, RouterConfig
from kvtier.core.config.store import PoolConfig, RemoteConfig, StoreConfig

__all__ = [
    "AuthConfig",
    "BackendConfig",
    "ConnectorConfig",
    "IndexConfig",
    "KvtierConfig",
    "PoolConfig",
    "RemoteConfig",
    "RouterConfig",
    "StoreConfig",
    "StoreSource",
    "VllmSource",
    "load_config",
]


class KvtierConfig(BaseSettings):
    """Root of the configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix="KVTIER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        hide_input_in_errors=True,  # errors name the field, never echo a value (Section)
    )

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    store: StoreConfig = Field(default_factory=StoreConfig)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _one_index_address(self) -> KvtierConfig:
        """``store.index_address`` is the old name of ``index.address``."""
        if self.store.index_address:
            warnings.warn(
                "store.index_address is deprecated: set index.address",
                DeprecationWarning,
                stacklevel=2,
            )
            if not self.index.address:
                self.index.address = self.store.index_address
        return self

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
