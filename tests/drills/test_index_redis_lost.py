"""A Redis that comes back without its data: the index notices (generation key), says it is
not ready while it rebuilds itself, and answers right again once every source resent its
state. A Redis that restarts *with* its data is no reason to resync.

The drills run real processes: ``redis-server``, a node store, and ``kvtier index serve``
(probed over HTTP). The unit tests drive ``RedisIndex`` against the session's Redis.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from kvtier.core.chunks import Tier
from kvtier.core.config import StoreConfig
from kvtier.core.config.index import IndexConfig, VllmSource
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import ApplyStatus, ChunkOp, LocationKind, Query, Registration
from kvtier.index.backends.redis import RedisIndex
from kvtier.index.ingest.vllm_wire import BlockStored
from kvtier.index.server.service import IndexService
from kvtier.store.api.events import EventKind
from kvtier.tiers import connect

from support.helpers import (
    IndexProcess,
    RedisServer,
    StoreProcess,
    free_port,
    http_json,
    start_index_process,
    start_redis,
    start_store_process,
)
from support.vllm_fixtures import FaultyPublisher, wait_for

CHUNK = 16 << 10
NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=32
)
NODE = "test-node"
DEADLINE = 60.0  # generous: the machine may be busy; nothing here asserts how fast


def keys_of(seed: int, n: int = 4) -> list[bytes]:
    tokens = np.arange(seed * 10_000, seed * 10_000 + n * NS.chunk_tokens, dtype=np.uint32)
    return prompt_keys(NS, tokens)


def put(address: str, keys: list[bytes]) -> None:
    """Commit chunks to the store (what a connector's save does)."""
    with connect(StoreConfig(address=address)) as tier:
        ns_id = tier.register_namespace(NS, CHUNK)
        tier.put(ns_id, keys, [np.full(CHUNK, i, np.uint8) for i in range(len(keys))])


def cpu_run(index: IndexProcess, keys: list[bytes]) -> int:
    """The node's leading CPU run of ``keys``, by the index's HTTP /query (0: not known)."""
    status, body = http_json(
        f"{index.http}/query", {"ns": NS.root_key().hex(), "keys": [k.hex() for k in keys]}
    )
    if status != 200 or not isinstance(body, dict):
        return 0  # e.g. 404 before the namespace is registered (again), 503 while Redis is down
    for holding in body["holdings"]:
        if holding["location"] == NODE:
            return int(holding["runs"].get("cpu", 0))
    return 0


def readyz(index: IndexProcess) -> tuple[int, dict]:
    status, body = http_json(f"{index.http}/readyz")
    assert isinstance(body, dict)
    return status, body


def metric(index: IndexProcess, name: str) -> float | None:
    status, text = http_json(f"{index.http}/metrics")
    assert status == 200 and isinstance(text, str)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def restart_redis(server: RedisServer) -> None:
    """SIGKILL redis-server and start it again on the same port, from whatever its dir holds
    (nothing, unless the test saved an RDB: the server runs with ``--save ""``)."""
    server.proc.kill()
    server.proc.wait()
    server.proc = start_redis(server.workdir, server.port).proc


@pytest.fixture
def redis_alone(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own: it will be killed and restarted."""
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def drill(
    run_dir: Path, redis_alone: RedisServer
) -> Iterator[tuple[StoreProcess, IndexProcess, list[bytes]]]:
    """A store holding committed chunks and an index process (Redis backend) following it,
    the chunks indexed."""
    store = start_store_process(run_dir, "16MiB", node_id=NODE)
    index: IndexProcess | None = None
    try:
        keys = keys_of(1)
        put(store.address, keys)
        index = start_index_process(
            "--backend", "redis", "--redis-url", redis_alone.url, "--store", store.address,
            "--probe-interval", "0.2", "--heartbeat-timeout", "300",
            env={"KVTIER_INDEX__CLAIM_TTL_S": "0.8"},
        )  # fmt: skip
        wait_for(lambda: cpu_run(index, keys) == 4, timeout=DEADLINE, what="the store indexed")
        assert readyz(index)[0] == 200
        yield store, index, keys
    finally:
        if index is not None:
            index.stop()
        store.stop()


def test_redis_lost_its_data_index_resyncs(
    drill: tuple[StoreProcess, IndexProcess, list[bytes]], redis_alone: RedisServer
) -> None:
    store, index, keys = drill
    assert metric(index, "kvtier_index_backend_resets_total") == 0.0
    # Freeze the store first: its follower cannot resend its state until it is thawed, so the
    # not-ready window stays open for as long as the test looks (no race with a fast resync).
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        restart_redis(redis_alone)  # back EMPTY: no namespaces, locations, entries

        def lost() -> dict | None:
            status, body = readyz(index)
            return body if status == 503 and "lost its data" in body.get("reason", "") else None

        body = wait_for(lost, timeout=DEADLINE, what="/readyz: not ready, backend lost")
        assert body["status"] == "degraded"
        assert "resyncing" in body["reason"] and NODE in body["reason"], body
        assert metric(index, "kvtier_index_backend_resets_total") == 1.0
        assert metric(index, "kvtier_index_resyncing") == 1.0
        assert cpu_run(index, keys) == 0  # nothing yet: the store has not resent its state
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    wait_for(lambda: readyz(index)[0] == 200, timeout=DEADLINE, what="ready again")
    assert metric(index, "kvtier_index_resyncing") == 0.0
    assert metric(index, "kvtier_index_backend_resets_total") == 1.0
    assert cpu_run(index, keys) == 4  # found again, from the store's snapshot
    status, namespaces = http_json(f"{index.http}/namespaces")
    assert status == 200 and isinstance(namespaces, dict) and NS.root_key().hex() in namespaces
    status, locations = http_json(f"{index.http}/locations")
    assert status == 200 and isinstance(locations, list)
    assert [(loc["location"], loc["status"]) for loc in locations] == [(NODE, "up")]
    # and it follows on live: a chunk committed now is indexed
    more = keys_of(2)
    put(store.address, more)
    wait_for(lambda: cpu_run(index, more) == 4, timeout=DEADLINE, what="a live event after")
    assert readyz(index)[0] == 200


def test_redis_restarted_with_its_data_is_no_reset(
    drill: tuple[StoreProcess, IndexProcess, list[bytes]], redis_alone: RedisServer
) -> None:
    _, index, keys = drill
    client = redis.Redis(port=redis_alone.port)
    client.save()  # an RDB in its dir: the restarted server loads it (same generation key)
    client.close()
    restart_redis(redis_alone)
    reasons: list[str] = []

    def restarted() -> bool:
        status, body = readyz(index)
        if status != 200:
            reasons.append(body.get("reason", ""))
        return metric(index, "kvtier_index_backend_restarts_total") == 1.0

    wait_for(restarted, timeout=DEADLINE, what="the index saw the restart")
    wait_for(lambda: readyz(index)[0] == 200, timeout=DEADLINE, what="ready")
    assert not [r for r in reasons if "lost its data" in r], reasons
    assert metric(index, "kvtier_index_backend_resets_total") == 0.0
    assert metric(index, "kvtier_index_resyncing") == 0.0
    assert cpu_run(index, keys) == 4


def test_idle_vllm_engine_is_relearned_after_redis_lost_its_data(
    redis_alone: RedisServer,
) -> None:
    """An idle engine sends nothing that would reveal the loss: the reset alone makes its
    follower register again and replace with what its mapper learned."""
    port, replay = free_port(), free_port()
    pub = FaultyPublisher(port, replay)
    config = IndexConfig(
        backend="redis", redis_url=redis_alone.url, grpc_port=0, http_port=0,
        probe_interval_s=0.2, claim_ttl_s=0.8, heartbeat_timeout_s=300,
        vllm=[VllmSource(instance="eng", endpoint=f"tcp://127.0.0.1:{port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv",
                         namespaces=[NS])],
    )  # fmt: skip
    service = IndexService.start(config)
    tokens = list(range(1000, 1000 + 3 * NS.chunk_tokens))

    def total() -> int:
        try:
            result = service.ingest.index.query_one(Query(NS.root_key(), tokens=tokens))
        except KvtierError:  # the namespace is not registered again yet
            return 0
        holding = result.of("eng")
        return holding.total if holding else 0

    try:
        pub.publish([BlockStored(
            block_hashes=[11, 12, 13, 14, 15, 16], parent_block_hash=None, token_ids=tokens,
            block_size=16, lora_id=None, medium="GPU", lora_name=None,
        )])  # fmt: skip
        wait_for(lambda: total() == 3, timeout=DEADLINE, what="the engine's prompt")
        resyncs = service.ingest.sources()[0].resyncs
        restart_redis(redis_alone)
        wait_for(lambda: service.backend.backend_resets().resets == 1, timeout=DEADLINE,
                 what="the reset noticed")  # fmt: skip
        wait_for(lambda: total() == 3, timeout=DEADLINE, what="relearned without a new event")
        wait_for(lambda: http_json(f"http://{service.http_address}/readyz")[0] == 200,
                 timeout=DEADLINE, what="ready again")  # fmt: skip
        assert service.ingest.resyncing() == []
        assert service.ingest.sources()[0].resyncs > resyncs
        assert service.backend.backend_resets().resets == 1
    finally:
        service.stop()
        pub.close()


# -- RedisIndex against the session's Redis ------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t:{uuid.uuid4().hex[:8]}:"


def wipe(server: RedisServer, prefix: str) -> None:
    """What a Redis restarted empty looks like to one cluster's keys."""
    client = redis.Redis(port=server.port)
    for key in client.scan_iter(match=prefix.encode() + b"*"):
        client.delete(key)
    client.close()


def test_reset_rewrites_namespaces_and_own_locations(
    redis_server: RedisServer, prefix: str
) -> None:
    ours, theirs = RedisIndex(redis_server.url, prefix), RedisIndex(redis_server.url, prefix)
    try:
        ns_id = ours.register_namespace(NS)
        by_id = ours.register_namespace(b"\x07" * 16)  # known by id only (a store's)
        ours.register(Registration("node-a", LocationKind.NODE, (ns_id, by_id)))
        theirs.register(Registration("node-b", LocationKind.NODE, (ns_id,)))
        ours.replace("node-a", {Tier.CPU: {ns_id: keys_of(3)}}, epoch=5, seq=1)
        op = ChunkOp(EventKind.STORED, Tier.CPU, ns_id, tuple(keys_of(4)))
        assert ours.apply("node-a", [op], epoch=5, seq_from=2, seq_to=2) is ApplyStatus.APPLIED
        assert ours.health()[0].value == "ok" and ours.backend_resets().resets == 0

        wipe(redis_server, prefix)
        health, _ = ours.health()  # the check: finds the generation gone, rewrites
        state = ours.backend_resets()
        assert health.value == "ok" and state.resets == 1 and not state.recovering
        assert "lost its data (generation key missing" in state.reason
        assert ours.namespaces() == {ns_id: NS, by_id: None}
        (info,) = ours.locations()  # its own only: node-b is for its registrant to rewrite
        assert info.registration.location == "node-a"
        assert (info.cursor.epoch, info.cursor.seq) == (0, 0) and info.entries[Tier.CPU] == 0
        # its writer, if it missed the reset, is told to resync by the cursor
        assert ours.apply("node-a", [op], epoch=5, seq_from=3, seq_to=3) is ApplyStatus.RESYNC

        theirs.health()  # the other replica: the generation changed under it
        assert theirs.backend_resets().resets == 1
        assert "generation changed" in theirs.backend_resets().reason
        assert sorted(i.registration.location for i in ours.locations()) == ["node-a", "node-b"]
        ours.health()  # a generation adopted from the other is no second reset
        assert ours.backend_resets().resets == 1 and ours.backend_resets().restarts == 0
    finally:
        ours.flush()
        ours.close()
        theirs.close()


def test_a_write_finding_its_location_gone_detects_the_reset(
    redis_server: RedisServer, prefix: str
) -> None:
    index = RedisIndex(redis_server.url, prefix)
    try:
        ns_id = index.register_namespace(NS)
        index.register(Registration("inst", LocationKind.INSTANCE, (ns_id,)))
        wipe(redis_server, prefix)
        op = ChunkOp(EventKind.STORED, Tier.GPU, ns_id, tuple(keys_of(4)))
        with pytest.raises(KvtierError) as err:
            index.apply("inst", [op], epoch=1, seq_from=1, seq_to=1)
        assert err.value.code is ErrorCode.UNKNOWN_LOCATION
        assert index.backend_resets().resets == 1  # no health check needed
        # registered again meanwhile: the writer's whole-state write goes through
        index.replace("inst", {Tier.GPU: {ns_id: op.keys}}, epoch=1, seq=1)
        assert index.locations()[0].entries[Tier.GPU] == 4
        index.flush()  # deleting the prefix on purpose is not a reset
        index.register_namespace(NS)
        assert index.health()[0].value == "ok" and index.backend_resets().resets == 1
    finally:
        index.flush()
        index.close()
