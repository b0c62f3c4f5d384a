"""``[index]``: the index service, its backend, and the sources it follows."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from kvtier.core.config.section import Section
from kvtier.core.keys import Namespace


class VllmSource(Section):
    """A vLLM engine publishing KV events (``--kv-events-config``) that the index follows."""

    instance: str = Field(description="identity of the engine in the index")
    endpoint: str = Field(description="its ZMQ PUB, e.g. tcp://10.0.0.5:5557 (we connect)")
    replay_endpoint: str | None = Field(
        None, description="its ZMQ ROUTER replay socket; without it gaps cannot be recovered"
    )
    topic: str = Field("", description="ZMQ topic its events are published under")
    namespaces: list[Namespace] = Field(
        min_length=1, description="what its KV is: one namespace per rank it serves"
    )
    node: str = Field("", description="node the engine runs on (tells routers who is local)")
    api: str | None = Field(
        None, description="its OpenAI API base URL, e.g. http://10.0.0.5:8000 (for routers)"
    )


class StoreSource(Section):
    """A node store whose event stream the index follows."""

    address: str = Field(description="host:port of the store's gRPC API")


class IndexConfig(Section):
    """The global chunk index (``kvtier index serve``) and the client's view of it."""

    address: str | None = Field(
        None, description="client side: host:port of a running index; unset = embedded index"
    )
    backend: Literal["memory", "redis", "redis-cluster"] = Field(
        "memory",
        description="memory: this process holds the index; redis: replicas share redis_url; "
        "redis-cluster: replicas share a Redis Cluster (redis_url: any of its nodes), the "
        "index cut into redis_shards (redis_placement says by what)",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="the Redis server of backend = redis"
    )
    redis_shards: int = Field(
        6,
        ge=1,
        le=1024,
        description="backend = redis-cluster: shards the index is cut into, spread evenly over "
        "the hash slots (so over masters owning equal slot ranges); every index process sharing "
        "the prefix uses the same number",
    )
    redis_placement: Literal["namespace", "chunk"] = Field(
        "namespace",
        description="backend = redis-cluster: namespace: a namespace's chunks in one shard (a "
        "prompt's query is one call to one master); chunk: each chunk in its key's shard, so "
        "one namespace's writes spread over every master (a query asks each shard for its "
        "chunks). Every index process sharing the prefix uses the same",
    )
    redis_prefix: str = Field("kvtier:index:", description="key prefix (one per cluster)")
    redis_timeout_s: float = Field(1.0, gt=0, description="deadline of one Redis call")
    grpc_host: str = Field("127.0.0.1", description="address the gRPC API binds")
    grpc_port: int = Field(50561, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_host: str = Field(
        "127.0.0.1", description="address the HTTP API (health, metrics, queries) binds"
    )
    http_port: int = Field(50562, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    grpc_workers: int = Field(8, ge=2, description="threads serving gRPC calls")
    heartbeat_timeout_s: float = Field(
        30.0, gt=0, description="a location silent this long is dropped (entries removed)"
    )
    probe_interval_s: float = Field(
        2.0, gt=0, description="how often followers check their sources (replay probe, info)"
    )
    replay_timeout_s: float = Field(5.0, gt=0, description="wait for a vLLM replay answer")
    claim_ttl_s: float = Field(
        6.0, gt=0, description="replicas sharing Redis: how long one's claim on a source lasts"
    )
    max_claim_ttl_s: float = Field(
        30.0,
        gt=0,
        description="the longest a writer claim lasts without renewal, whatever its claimant "
        "asked: a claimant that stops renewing (or a claim set by anything else) lapses this "
        "soon, and a replica standing by takes the source over",
    )
    source_grace_s: float = Field(
        30.0,
        gt=0,
        description="a followed source blinded this long makes the index report itself "
        "degraded (/readyz 503): a configured source that cannot be followed (not live, "
        "source not down), or any source whose writes the index does not take, or one "
        "standing by while no replica writes it",
    )
    feed_changes: int = Field(
        65536,
        ge=0,
        description="writes the change feed keeps for routers' in-process replicas (router."
        "index_replica); a replica further behind loads a snapshot again. 0: no feed (routers "
        "query). The redis backend keeps none (replicas of the index share it)",
    )
    max_dynamic_followers: int = Field(
        256,
        ge=0,
        description="sources registered over the API (endpoints in Register) that the index "
        "follows at most; past it Register answers LIMIT_EXCEEDED",
    )
    max_namespaces: int = Field(
        16384,
        ge=1,
        description="namespaces the index knows at most (definitions and ids); past it a new "
        "one is refused with LIMIT_EXCEEDED (definitions are bounded: at most ~64 MiB)",
    )
    max_namespace_bytes: int = Field(
        16384,
        ge=1024,
        description="the largest namespace definition (its JSON) RegisterNamespace accepts, "
        "refused before it is parsed (a definition within kvtier.core.keys' field bounds is "
        "~4 KiB)",
    )
    replica_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="this index process among replicas (the owner of its claims)",
        json_schema_extra={"default_doc": "HOSTNAME-PID"},
    )
    vllm: list[VllmSource] = Field(
        default_factory=list, description="vLLM engines whose KV events the index follows"
    )
    stores: list[StoreSource] = Field(
        default_factory=list, description="node stores whose event streams the index follows"
    )

    @model_validator(mode="after")
    def _check(self) -> IndexConfig:
        names = [s.instance for s in self.vllm]
        if len(names) != len(set(names)):
            raise ValueError("index.vllm: instance names must be unique")
        if self.claim_ttl_s <= self.probe_interval_s:
            raise ValueError("index.claim_ttl_s must exceed probe_interval_s (claims are renewed)")
        if self.max_claim_ttl_s < self.claim_ttl_s:
            raise ValueError("index.max_claim_ttl_s must be at least claim_ttl_s")
        return self
