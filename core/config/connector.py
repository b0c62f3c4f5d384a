"""``[connector]``: how a vLLM instance uses kvtier. vLLM's ``kv_connector_extra_config`` is
this section's flags (see ``kvtier.connector.config``). The store and index it talks to are
``[store]`` and ``[index]`` (``store.address``, ``index.address``): one place each."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kvtier.core.config.section import Renamed, Section

SavePolicy = Literal["none", "prompt", "prompt_and_output"]
LoadMode = Literal["async", "sync"]
TierName = Literal["cpu", "disk", "remote"]


class ConnectorConfig(Section):
    """How a vLLM instance uses kvtier."""

    SECTION: ClassVar[str] = "connector"
    RENAMED: ClassVar[dict[str, Renamed]] = {
        "lookup_wait_ms": Renamed("lookup_wait_s", 1e-3),
        "lookup_deadline_ms": Renamed("lookup_deadline_s", 1e-3),
        "save_wait_ms": Renamed("save_wait_s", 1e-3),
        "lease_ttl_s": Renamed("load_lease_ttl_s"),
        "max_namespaces": Renamed("namespace_cache_size"),
    }

    instance_id: str | None = Field(
        None, description="this instance's identity in the index (default: vLLM's engine id)"
    )
    instance_host: str = Field(
        "127.0.0.1", description="host the index reaches this vLLM's KV-event sockets at"
    )
    instance_api: str | None = Field(
        None,
        description="this instance's OpenAI API base URL (e.g. http://10.0.0.5:8000): "
        "announced to the index so routers find it",
    )
    chunk_tokens: int = Field(
        256,
        ge=1,
        description="tokens per chunk; a multiple of block_size. Larger chunks mean larger "
        "copies: on an H200 a DRAM load reached 0.85 of a pinned cudaMemcpy with 256, 0.91 "
        "with 512, 0.95 with 1024 (hits stop at the last whole chunk)",
    )
    tiers: list[TierName] = Field(
        default_factory=lambda: list[TierName](["cpu"]),
        description="where loads read from, in order: cpu (this node's DRAM pool, always "
        "first), disk (this node's disk, the store's store.disk) and remote (other nodes' "
        "pools, found through index.address)",
    )
    save: SavePolicy = Field(
        "prompt_and_output",
        description="which full chunks to store: none, prompt only, or prompt + generated "
        "tokens (an agent's next turn resends its output)",
    )
    cuda_copy_kernel: bool = Field(
        False,
        description="CUDA: copy each layer's pages with one kernel over the pool's device "
        "mapping instead of the copy engine. Faster for small pages (MLA with 64-token "
        "blocks: 0.84 of the floor against 0.65) but it takes SMs from the forward, which "
        "then hides far less of a layer-wise load (docs/benchmarks.md)",
    )
    load_mode: LoadMode = Field(
        "sync",
        description="sync: load inside the request's first step, layer by layer, each attention "
        "layer waiting only for its own pages; async: the request waits while other requests "
        "compute and is scheduled the step after its load (a whole extra step: on a busy CPU "
        "engine, longer than the load)",
    )
    min_hit_tokens: dict[TierName, int] = Field(
        default_factory=lambda: dict[TierName, int]({"cpu": 256, "remote": 1024}),
        description="skip a tier whose run is shorter than this: below it, recomputing "
        "is cheaper than the load's fixed cost",
    )
    lookup_wait_s: float = Field(
        0.005,
        ge=0,
        description="per engine step, wait at most this long in total for store lookups "
        "before telling vLLM 'ask again' (one budget shared by every waiting request); a "
        "lookup is waited for in one step only, later steps just look whether it is done",
    )
    max_pending_lookups: int = Field(
        64,
        ge=1,
        description="lookups in flight at most; a request arriving past it is a miss "
        "(recomputed) instead of queueing behind a slow store",
    )
    lookup_deadline_s: float = Field(
        5.0,
        gt=0,
        description="a lookup still pending this long after it started answers 'no hit' "
        "(the request recomputes) instead of 'ask again'",
    )
    router_hint_max_age_s: float = Field(
        2.0,
        ge=0,
        description="take the router's word on other nodes' runs of a prompt "
        "(kvtier.core.engine_hint) if the request arrived at most this long ago, and skip "
        "the remote tier's index query when no other node could extend this node's run; "
        "0: always ask the index",
    )
    save_wait_s: float | None = Field(
        None,
        ge=0,
        description="a step waits this long for pool space for the chunks it completes; a "
        "later answer is used in a later step (the blocks are held until copied). Unset: 0 "
        "(never wait: the answer, due within the step's forward pass, goes with the next "
        "step; kvtier bench decode-overhead measured a 2 ms wait at ~0.3 ms of every step), "
        "but 2 ms for a model with a sliding window, whose blocks a late save may find freed",
        json_schema_extra={"default_doc": "0, or 0.002 with a sliding window"},
    )
    save_held_chunks: int | None = Field(
        None,
        ge=0,
        description="pool space, in chunks per TP rank, the connector holds ahead with a node "
        "store (refilled off the scheduler thread), so a step's saves never wait for the "
        "store: the copy goes out in the step that computed the chunks. Unset: for a model "
        "with a sliding window, local attention or Mamba state (whose blocks a save sent a "
        "step later may find freed) the chunks of two full prefill steps, at most 1/32 of the "
        "pool; off for full attention. 0: off (every save asks the store)",
        json_schema_extra={
            "default_doc": "2 * max_num_batched_tokens / chunk_tokens (at most pool/32) for a "
            "model whose blocks do not stay; off for full attention"
        },
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
    namespace_cache_size: int = Field(
        4096,
        ge=1,
        description="namespace registrations (salts x adapters) this instance remembers, to "
        "re-register them after a store restart; the least recently used go first. Not a "
        "limit: the store bounds namespaces with store.max_namespaces",
    )
    load_lease_ttl_s: float = Field(
        60.0,
        gt=0,
        description="TTL the connector asks for the read leases it holds on a hit from lookup "
        "to load (the store grants at most store.max_lease_ttl_s)",
    )
    remote_fetch_timeout_s: float = Field(
        2.0, gt=0, description="a pull from another node's store ends by then (else recompute)"
    )
    disk_timeout_s: float = Field(
        1.0,
        gt=0,
        description="a stage from this node's disk leaves files not started by then to recompute",
    )
    kappa_file: Path | None = Field(
        None,
        description="per-length cost table measured by kvtier bench tier-latency --kappa-out: "
        "a disk run whose length it prices at no saving over a recompute is not staged",
    )
    verify_loads: bool = Field(
        True,
        description="check each loaded chunk's checksum before vLLM uses it (an XXH3 pass over "
        "its bytes: ~3 % of an 8k-token DRAM hit, docs/connector.md)",
    )
    verify_threads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="threads that checksum a load's chunks side by side; default: 1 on a CPU "
        "engine (its forward owns the cores), on CUDA half the cores up to 8 (a PCIe gen 5 "
        "copy outruns one thread's XXH3 ~8x: docs/benchmarks.md, CUDA copy path)",
    )
    model_id: str | None = Field(
        None, description="model identity in chunk keys (default: vLLM's model name)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> ConnectorConfig:
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers lists a tier twice: {self.tiers}")
        if "remote" in self.tiers and self.lookup_deadline_s < self.remote_fetch_timeout_s:
            raise ValueError(
                "lookup_deadline_s must exceed remote_fetch_timeout_s (a pull would always be "
                "given up before it could finish)"
            )
        if "disk" in self.tiers and self.lookup_deadline_s < self.disk_timeout_s:
            raise ValueError(
                "lookup_deadline_s must exceed disk_timeout_s (a stage would always be given "
                "up before it could finish)"
            )
        return self
