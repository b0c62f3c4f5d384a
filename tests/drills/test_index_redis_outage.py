"""A Redis that disappears mid-run: queries keep answering (degraded), nothing crashes, and
the index is whole again once Redis is back, even when it came back empty."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.config.index import IndexConfig, VllmSource
from kvtier.core.keys import Namespace
from kvtier.index.api import IndexHealth, Query
from kvtier.index.ingest.vllm_wire import BlockStored
from kvtier.index.server.service import IndexService

from support.helpers import RedisServer, free_port, http_json, start_redis
from support.vllm_fixtures import FaultyPublisher, wait_for

NS = Namespace(model="m", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=32)
_hashes = iter(range(1, 1 << 40))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(3 * 32)]


def stored(tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=[next(_hashes) for _ in range(len(tokens) // 16)], parent_block_hash=None,
        token_ids=tokens, block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip


@pytest.fixture
def redis_alone(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own: it will be paused, killed and restarted."""
    server = start_redis(tmp_path / "redis")
    yield server
    if server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


def test_queries_degrade_then_recover(redis_alone: RedisServer) -> None:
    port, replay = free_port(), free_port()
    pub = FaultyPublisher(port, replay)
    config = IndexConfig(
        backend="redis", redis_url=redis_alone.url, redis_timeout_s=0.3, grpc_port=0,
        http_port=0, probe_interval_s=0.2, claim_ttl_s=0.8,
        vllm=[VllmSource(instance="eng", endpoint=f"tcp://127.0.0.1:{port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv",
                         namespaces=[NS])],
    )  # fmt: skip
    service = IndexService.start(config)
    index = service.ingest.index  # the metered backend the API serves
    http = f"http://{service.http_address}"

    def run(tokens: list[int]) -> tuple[IndexHealth, int]:
        result = index.query_one(Query(NS.root_key(), tokens=tokens))
        holding = result.of("eng")
        return result.health, holding.total if holding else 0

    try:
        a, b, c = prompt(1), prompt(2), prompt(3)
        pub.publish([stored(a)])
        wait_for(lambda: run(a) == (IndexHealth.OK, 3), what="first prompt")
        # Redis stops answering (paused): queries time out into degraded answers
        os.kill(redis_alone.proc.pid, signal.SIGSTOP)
        assert run(a) == (IndexHealth.DEGRADED, 0)
        assert index.query_one(Query(b"\x09" * 16, keys=[])).health is IndexHealth.DEGRADED
        status, body = http_json(f"{http}/readyz")
        assert status == 503 and body["status"] == "degraded" and "unreachable" in body["reason"]
        status, metrics = http_json(f"{http}/metrics")
        assert status == 200 and "kvtier_index_degraded 1.0" in metrics
        status, body = http_json(f"{http}/query", {"ns": NS.root_key().hex(), "tokens": a})
        assert status == 200 and body["health"] == "degraded"
        pub.publish([stored(b)])  # the follower cannot write it now
        wait_for(lambda: "index:" in service.ingest.sources()[0].detail, what="follower noticed")
        os.kill(redis_alone.proc.pid, signal.SIGCONT)
        wait_for(lambda: run(b) == (IndexHealth.OK, 3), what="written once Redis is back")
        assert run(a) == (IndexHealth.OK, 3)
        assert http_json(f"{http}/readyz")[0] == 200
        # Redis dies and comes back empty: the follower registers again and sends it all
        redis_alone.stop()
        assert run(a) == (IndexHealth.DEGRADED, 0)
        pub.publish([stored(c)])
        redis_alone.restart()
        wait_for(lambda: run(c) == (IndexHealth.OK, 3), timeout=15, what="after an empty Redis")
        assert run(a) == (IndexHealth.OK, 3) and run(b) == (IndexHealth.OK, 3)
        assert service.ingest.sources()[0].resyncs >= 3
    finally:
        service.stop()
        pub.close()
