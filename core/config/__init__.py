"""One typed configuration for every kvtier process.

Sources, lowest to highest precedence: defaults < config file (TOML) < environment < flags.

- file: ``--config PATH`` or ``KVTIER_CONFIG=PATH``; sections mirror the model
  (``[store]``, ``[store.pool]``, ...).
- environment: ``KVTIER_<SECTION>__<FIELD>``, e.g. ``KVTIER_STORE__POOL__CAPACITY=8GiB``. No
  other variables are read: the model is the list of settings.
- flags: each CLI command maps its options onto fields of this model.

Durations are ``*_s`` keys in seconds. A renamed key's old name is still accepted, with a
``ConfigDeprecationWarning``, from every source (``Section.RENAMED``). docs/configuration.md
lists every key (``kvtier config docs`` writes it); ``kvtier config show`` prints the
effective config and where each value came from.

Defaults work on one machine with nothing else running.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo
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
from kvtier.core.config.section import ConfigDeprecationWarning, Renamed, Section, deprecated
from kvtier.core.config.store import PoolConfig, RemoteConfig, StoreConfig

__all__ = [
    "MOVED",
    "AuthConfig",
    "BackendConfig",
    "ConfigDeprecationWarning",
    "ConnectorConfig",
    "IndexConfig",
    "KvtierConfig",
    "PoolConfig",
    "RemoteConfig",
    "Renamed",
    "RouterConfig",
    "Section",
    "SourceRecord",
    "StoreConfig",
    "StoreSource",
    "VllmSource",
    "load_config",
    "load_config_with_sources",
    "section_type",
]


# Keys moved to another section: old dotted name -> new one (still accepted, with a warning).
MOVED = {"store.index_address": "index.address"}


class KvtierConfig(BaseSettings):
    """Root of the configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix="KVTIER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        hide_input_in_errors=True,  # errors name the field, never echo a value (Section)
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="least severe log record written (every kvtier process)"
    )
    store: StoreConfig = Field(default_factory=StoreConfig)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _one_index_address(self) -> KvtierConfig:
        """``store.index_address`` is the old name of ``index.address``."""
        if self.store.index_address:
            deprecated(
                "config key store.index_address is deprecated: set index.address; the old "
                "name goes in the next release"
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
        # First wins: flags (init kwargs) > environment > file. Each source's old key names
        # are renamed before they merge, so an old name in the file still loses to the new
        # one in the environment.
        sources: list[PydanticBaseSettingsSource] = [
            _Renaming(settings_cls, init_settings, "flag"),
            _Renaming(settings_cls, env_settings, "env"),
        ]
        path = _CONFIG_FILE.get("path")
        if path is not None:
            toml = TomlConfigSettingsSource(settings_cls, toml_file=path)
            sources.append(_Renaming(settings_cls, toml, f"file {path}"))
        return tuple(sources)


def section_type(field: FieldInfo) -> type[BaseModel] | None:
    """The section a field holds (``store.pool``: ``PoolConfig``), or None for a value."""
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _upgrade_tree(
    model: type[BaseModel], data: Any, source: str, prefix: str, renamed: dict[str, str]
) -> Any:
    """``data`` with the old key names of ``model`` and its sections renamed; ``renamed``
    collects new dotted path -> old one. A section naming a key twice (old and new) is left
    as it is, for its validator to refuse."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    if issubclass(model, Section) and model.RENAMED:
        try:
            upgraded = model.upgrade_keys(out, source)
        except ValueError:
            return out
        for old, rename in model.RENAMED.items():
            if old in out:
                renamed[prefix + rename.new] = prefix + old
        out = upgraded
    for name, field in model.model_fields.items():
        sub = section_type(field)
        if sub is not None and name in out:
            out[name] = _upgrade_tree(sub, out[name], source, f"{prefix}{name}.", renamed)
    return out


class _Renaming(PydanticBaseSettingsSource):
    """A source with the old names of renamed keys (``Section.RENAMED``) replaced by the
    new ones; while ``load_config_with_sources`` runs, it records what it set."""

    def __init__(
        self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource, label: str
    ) -> None:
        super().__init__(settings_cls)
        self.inner = inner
        self.label = label

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.inner.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        renamed: dict[str, str] = {}
        data = _upgrade_tree(self.settings_cls, self.inner(), self.label, "", renamed)
        record = _RECORD.get()
        if record is not None:
            record.append((self.label, data, renamed))
        return data


# (source label, what it set, new dotted key -> the old name it was set by), first wins
SourceRecord = list[tuple[str, dict[str, Any], dict[str, str]]]
_RECORD: ContextVar[SourceRecord | None] = ContextVar("kvtier_config_record", default=None)


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


def load_config_with_sources(
    file: str | Path | None = None, **flags: Any
) -> tuple[KvtierConfig, SourceRecord]:
    """``load_config``, and what each source set: (label, values, renamed keys) for flags,
    environment and file, highest precedence first (``kvtier config show``)."""
    record: SourceRecord = []
    token = _RECORD.set(record)
    try:
        config = load_config(file, **flags)
    finally:
        _RECORD.reset(token)
    return config, record


def _merge_with_sources(flags: dict[str, Any]) -> KvtierConfig:
    # pydantic-settings merges nested sections of init kwargs over env/file section by section,
    # so a flag for store.grpc_port keeps store.pool from the file.
    return KvtierConfig(**flags)
