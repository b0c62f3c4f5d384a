"""The connector's settings: kvtier's config model with vLLM's ``kv_connector_extra_config``
as its flags.

``kv_connector_extra_config`` overrides the config file (``KVTIER_CONFIG``) and environment
(``KVTIER_CONNECTOR__...``): its keys are ``[connector]`` fields, plus ``store_address`` and
``index_address`` (``store.address`` and ``index.address``: unset = an embedded store / no
index), plus whole ``store`` and ``index`` sections for anything else (e.g.
``{"store": {"pool": {"capacity": "4GiB"}}}`` sizes an embedded store). Unknown or
contradictory keys fail vLLM's start-up with a message saying which key and why.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {
                               "store_address": "127.0.0.1:50551",    # unset: embedded store
                               "index_address": "127.0.0.1:50561",    # unset: no remote tier
                               "chunk_tokens": 256,
                               "tiers": ["cpu", "remote"],
                               "save": "prompt_and_output"}}'
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from kvtier.core.config import KvtierConfig, load_config
from kvtier.core.config.connector import ConnectorConfig, LoadMode, SavePolicy, TierName

__all__ = [
    "ConnectorConfig",
    "ConnectorConfigError",
    "LoadMode",
    "SavePolicy",
    "TierName",
    "parse_extra_config",
]

log = logging.getLogger(__name__)

# flag -> the field it sets (dotted path in the config model)
ADDRESS_FLAGS = {"store_address": "store.address", "index_address": "index.address"}
# older names, still accepted with a warning
DEPRECATED_FLAGS = {
    "embedded_capacity": "store.pool.capacity",
    "embedded_eviction": "store.pool.eviction",
}


class ConnectorConfigError(ValueError):
    pass


def parse_extra_config(extra: dict[str, Any] | None) -> KvtierConfig:
    """The whole config model, ``kv_connector_extra_config`` applied over file and env. That
    ``chunk_tokens`` is whole KV blocks is checked against the cache vLLM allocated
    (``layout.describe``)."""
    extra = dict(extra or {})
    sections: dict[str, Any] = {s: dict(extra.pop(s)) for s in ("store", "index") if s in extra}
    given: set[str] = set()
    for name, path in {**ADDRESS_FLAGS, **DEPRECATED_FLAGS}.items():
        if name in extra:
            _set(sections, path, extra.pop(name))
            given.add(path)
            if name in DEPRECATED_FLAGS:
                log.warning("kvtier: %s is deprecated: set %s instead", name, path)
    try:
        # old key names become new ones first, so they override the file's new names
        extra = ConnectorConfig.upgrade_keys(extra, "kv_connector_extra_config")
        base = load_config().connector.model_dump()
        connector = ConnectorConfig.model_validate({**base, **extra})
        config = load_config(**sections)
        config.connector = connector
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '(config)'}: {e['msg']}" for e in exc.errors()
        ]
        raise ConnectorConfigError(
            "invalid kv_connector_extra_config for KvtierConnector:\n" + "\n".join(lines)
        ) from None
    except ValueError as exc:  # an old key name beside its new one
        raise ConnectorConfigError(
            f"invalid kv_connector_extra_config for KvtierConnector:\n  {exc}"
        ) from None
    if "remote" in connector.tiers and not config.index.address:
        raise ConnectorConfigError(
            "tier 'remote' needs index_address (the index says who holds what)"
        )
    if config.store.address is not None and "store.pool.capacity" in given:
        raise ConnectorConfigError(
            "embedded_capacity configures the embedded store, but store_address points to a "
            "running store: set one or the other"
        )
    return config


def _set(nested: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        nested = nested.setdefault(part, {})
    nested[leaf] = value


def with_engine_constraints(
    config: ConnectorConfig, async_scheduling: bool, hybrid: bool = False
) -> ConnectorConfig:
    """The connector config this engine can run exactly: loads are async (a warning says why)
    where a sync load's failure could not be handled exactly.

    - With async scheduling (vLLM's default on CUDA) step N+1 is scheduled before step N's
      outputs are back: a sync load that fails in step N is known only after a step computed
      over its unloaded KV was scheduled, and that step's token reaches the user. Async loads
      are known complete before the request is scheduled at all.
    - With several KV cache groups (``hybrid``) vLLM takes load failures per request only, and
      only for requests waiting on an async load (block ids are per group there)."""
    if config.load_mode != "sync":
        return config
    if async_scheduling:
        log.warning(
            "kvtier: vLLM's async scheduling is on, so loads are async (load_mode: async): a "
            "sync load's failure would be known only after a step over its missing KV was "
            "already scheduled"
        )
    elif hybrid:
        log.info("kvtier: hybrid KV cache groups: loads are async (load_mode: async)")
    else:
        return config
    return config.model_copy(update={"load_mode": "async"})
