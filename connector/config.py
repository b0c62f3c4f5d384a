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
    lookup_deadline_ms: float = Field(
        5000.0,
        gt=0,
        description="a lookup still pending this long after it started answers 'no hit' "
        "(the request recomputes) instead of 'ask again'",
    )
    save_wait_ms: float = Field(
        2.0,
        ge=0,
        description="a step waits this long for pool space for the chunks it completes; a "
        "later answer is used in a later step (the blocks are held until copied)",
    )
    save_defer_s: float = Field(
        5.0, gt=0, description="pool space not granted by then: that save is given up"
    )
    store_timeout_s: float = Field(
        2.0, gt=0, description="deadline of one control call to the node store"
    )
    weights_tag: str = Field(
        "",
        description="operator's tag for weights changed in place (e.g. the training step): "
        "instances share chunks only with instances of the same tag",
    )
    on_reset: Literal["bump", "refuse"] = Field(
        "bump",
        description="reset_prefix_cache with a shared store: bump this instance's namespace "
        "(it no longer reads chunks stored before) or refuse the reset",
    )
    fingerprint_weights: bool = Field(
        True, description="read the weight files at start-up to fingerprint them (a few MB)"
    )
    max_namespaces: int = Field(
        4096, ge=1, description="namespaces (salts x adapters) remembered before the oldest go"
    )
    lease_ttl_s: float = Field(60.0, gt=0, description="read leases held from lookup to load")
    remote_fetch_timeout_s: float = Field(
        2.0, gt=0, description="a pull from another node's store ends by then (else recompute)"
    )
    verify_loads: bool = Field(
        True,
        description="check each loaded chunk's checksum before vLLM uses it (an XXH3 pass over "
        "its bytes: ~3 % of an 8k-token DRAM hit, docs/connector.md)",
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
        if "remote" in self.tiers and self.lookup_deadline_ms < self.remote_fetch_timeout_s * 1e3:
            raise ValueError(
                "lookup_deadline_ms must exceed remote_fetch_timeout_s (a pull would always be "
                "given up before it could finish)"
            )
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
