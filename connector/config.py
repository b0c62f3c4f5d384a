"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

``kv_connector_extra_config`` is the connector's flags: it overrides the ``[connector]`` and
``[store]`` sections of the kvtier config file (``KVTIER_CONFIG``) and environment
(``KVTIER_CONNECTOR__...``). Unknown or contradictory keys fail vLLM's start-up with a message
saying which key and why.

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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SavePolicy = Literal["none", "prompt", "prompt_and_output"]
LoadMode = Literal["async", "sync"]
TierName = Literal["cpu", "remote"]


class ConnectorConfig(BaseModel):
    """How a vLLM instance uses kvtier."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    store_address: str | None = Field(
        None, description="host:port of the node store; unset = an embedded store"
    )
    index_address: str | None = Field(
        None, description="host:port of the index (needed for the remote tier)"
    )
    instance_id: str | None = Field(
        None, description="this instance's identity in the index (default: vLLM's engine id)"
    )
    instance_host: str = Field(
        "127.0.0.1", description="host the index reaches this vLLM's KV-event sockets at"
    )
    chunk_tokens: int = Field(256, ge=1, description="tokens per chunk; a multiple of block_size")
    tiers: list[TierName] = Field(default_factory=lambda: ["cpu"])
    save: SavePolicy = Field(
        "prompt_and_output",
        description="which full chunks to store: none, prompt only, or prompt + generated "
        "tokens (an agent's next turn resends its output)",
    )
    load_mode: LoadMode = Field(
        "sync",
        description="sync: load inside the request's first step, layer by layer, each attention "
        "layer waiting only for its own pages; async: the request waits while other requests "
        "compute and is scheduled the step after its load (a whole extra step: on a busy CPU "
        "engine, longer than the load)",
    )
    min_hit_tokens: dict[TierName, int] = Field(
        default_factory=lambda: {"cpu": 256, "remote": 1024},
        description="skip a tier whose run is shorter than this: below it, recomputing "
        "is cheaper than the load's fixed cost",
    )
    lookup_wait_ms: float = Field(
        5.0, ge=0, description="wait this long for a store lookup before telling vLLM 'ask again'"
    )
    lease_ttl_s: float = Field(60.0, gt=0, description="read leases held from lookup to load")
    remote_fetch_timeout_s: float = Field(
        2.0, gt=0, description="a pull from another node's store ends by then (else recompute)"
    )
    verify_loads: bool = Field(
        False, description="check each loaded chunk's checksum (an extra pass over its bytes)"
    )
    model_id: str | None = Field(
        None, description="model identity in chunk keys (default: vLLM's model name)"
    )
    # The embedded store (used when store_address is unset).
    embedded_capacity: str = Field("1GiB", description="pool size of the embedded store")
    embedded_eviction: Literal["lru", "s3fifo"] = "s3fifo"

    @model_validator(mode="after")
    def _consistent(self) -> ConnectorConfig:
        if "remote" in self.tiers and not self.index_address:
            raise ValueError("tier 'remote' needs index_address (who holds what)")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers lists a tier twice: {self.tiers}")
        return self


class ConnectorConfigError(ValueError):
    pass


def parse_extra_config(extra: dict[str, Any] | None, block_size: int) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config`` (over the config file and environment)."""
    from kvtier.config import load_config

    try:
        base = load_config().connector.model_dump()
        config = ConnectorConfig.model_validate({**base, **(extra or {})})
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(map(str, e['loc'])) or '(config)'}: {e['msg']}" for e in exc.errors()
        ]
        raise ConnectorConfigError(
            "invalid kv_connector_extra_config for KvtierConnector:\n" + "\n".join(lines)
        ) from None
    if config.chunk_tokens % block_size:
        raise ConnectorConfigError(
            f"chunk_tokens={config.chunk_tokens} must be a multiple of vLLM's block_size "
            f"({block_size})"
        )
    if config.store_address is not None and "embedded_capacity" in (extra or {}):
        raise ConnectorConfigError(
            "embedded_capacity configures the embedded store, but store_address points to a "
            "running store: set one or the other"
        )
    return config
