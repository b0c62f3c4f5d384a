"""Blinding the index to a source, and saying so: real index, store and Redis processes.

- A cursor moved beyond what the store produced (what a foreign Replace left) does not blind
  the store's follower, live or after an index restart.
- A configured source the index cannot follow makes it report not ready.
- After Redis lost its data, a claim taken by anything but a live replica lapses within
  ``max_claim_ttl_s``; while nobody writes the source, ``/readyz`` says so. Claims over the
  API are for admins only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import prompt_keys
from kvtier.core.rpc import ClientAuth
from kvtier.index.api import Query
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.testing.services import Service, start_store
from kvtier.tiers.cpu import CpuTier

from support.grpc_recorder import GrpcRecorder
from support.helpers import RedisServer, start_redis
from support.index_rig import NS_A, client, readyz, refused, start_index
from support.secure_env import TOKENS, SecureStore, auth_env
from support.vllm_fixtures import wait_for

DEADLINE = 60.0  # generous: the machine may be busy; nothing here asserts how fast
CHUNK = 4096


def keys_of(seed: int, n: int = 3) -> list[bytes]:
    start = seed * 10_000
    return prompt_keys(NS_A, np.arange(start, start + n * NS_A.chunk_tokens, dtype=np.uint32))


def put(store: str, keys: list[bytes]) -> bytes:
    """Commit chunks as tenant a's engine; returns the namespace id."""
    engine = GrpcStoreClient(store, 5, auth=ClientAuth(TOKENS["engine-a"]))
    with CpuTier(engine) as tier:
        ns_id = tier.register_namespace(NS_A, CHUNK)
        tier.put(ns_id, keys, [np.zeros(CHUNK, np.uint8)] * len(keys))
    return ns_id


def cpu_run(index: Service, node: str, keys: list[bytes]) -> int:
    reader = client(index, "reader")
    try:
        holding = reader.query_one(Query(NS_A.root_key(), keys=keys)).of(node)
    except KvtierError:  # not (again) registered yet, Redis briefly empty
        return 0
    finally:
        reader.close()
    return holding.runs.get(Tier.CPU, 0) if holding else 0


@pytest.fixture
def redis_alone(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SecureStore]:
    socket = tmp_path / "sock" / "store.sock"
    service = start_store(
        tmp_path / "run", "16MiB", "blind-node", remote=False, env=auth_env(TOKENS["node"]),
        extra=("--unix-socket", str(socket)),
    )  # fmt: skip
    yield SecureStore(service, socket)
    service.stop()


def test_a_cursor_beyond_the_stores_events_does_not_blind_its_follower(
    store: SecureStore, redis_alone: RedisServer
) -> None:
    prefix = "t:blind:"
    index = start_index("--store", store.address, redis_url=redis_alone.url, prefix=prefix)
    loc_key = prefix.encode() + b"loc:blind-node"
    r = redis.Redis(port=redis_alone.port)
    try:
        first = keys_of(1)
        put(store.address, first)
        wait_for(lambda: cpu_run(index, "blind-node", first) == 3, DEADLINE, what="indexed")
        # far ahead of anything the store produced, in the store's own epoch
        r.hset(loc_key, "seq", 10**12)
        live = keys_of(2)
        put(store.address, live)
        wait_for(lambda: cpu_run(index, "blind-node", live) == 3, DEADLINE, what="learnt live")
        # and an index starting over such a cursor does not wait for batches that never come
        index.stop()
        r.hset(loc_key, "seq", 10**12)
        later = keys_of(3)
        put(store.address, later)
        index = start_index("--store", store.address, redis_url=redis_alone.url, prefix=prefix)
        wait_for(lambda: cpu_run(index, "blind-node", later) == 3, DEADLINE, what="learnt")
        assert cpu_run(index, "blind-node", first) == 3
    finally:
        r.close()
        index.stop()


def test_a_configured_source_it_cannot_follow_makes_the_index_not_ready() -> None:
    """A configured store that cannot prove it holds a node credential is not followed (and
    never sees the index's token): the index is blind to it, and says so."""
    recorder = GrpcRecorder()
    index = start_index("--store", recorder.address, env={"KVTIER_INDEX__SOURCE_GRACE_S": "1"})
    try:
        body = wait_for(lambda: (r := readyz(index))[0] == 503 and r[1], DEADLINE, what="not ready")
        assert body["status"] == "degraded" and recorder.address in body["reason"], body
        assert "failed" in body["reason"]
        assert not any(TOKENS["index"] in value for _, value in recorder.metadata)
    finally:
        index.stop()
        recorder.server.stop(0)


def test_a_foreign_claim_after_redis_lost_its_data_lapses_and_readiness_says_so(
    store: SecureStore, redis_alone: RedisServer
) -> None:
    prefix = b"t:claimed:"
    index = start_index(
        "--store", store.address, redis_url=redis_alone.url, prefix=prefix.decode(),
        env={"KVTIER_INDEX__CLAIM_TTL_S": "0.8", "KVTIER_INDEX__MAX_CLAIM_TTL_S": "8",
             "KVTIER_INDEX__SOURCE_GRACE_S": "1"},
    )  # fmt: skip
    r = redis.Redis(port=redis_alone.port)
    engine, admin = client(index, "engine-all"), client(index, "admin")
    try:
        before = keys_of(4)
        put(store.address, before)
        wait_for(lambda: cpu_run(index, "blind-node", before) == 3, DEADLINE, what="indexed")
        assert readyz(index)[0] == 200
        # the Claim RPC: admins only, and never longer than max_claim_ttl_s
        assert refused(engine.claim, "blind-node", "me", 3600.0).code is ErrorCode.PERMISSION_DENIED
        assert admin.claim("elsewhere", "ops", 3600.0)
        assert 0 < r.pttl(prefix + b"w:elsewhere") <= 8000
        # Redis loses everything, and the writer claim is taken by someone else for an hour
        pipe = r.pipeline(transaction=True)
        pipe.flushall()
        pipe.set(prefix + b"w:blind-node", b"intruder", px=3_600_000)
        pipe.execute()
        flushed = time.monotonic()

        def standby() -> bool:
            return any(s["state"] == "standby" for s in admin.stats()["sources"])

        wait_for(standby, DEADLINE, what="the follower standing by for the intruder")
        after = keys_of(5)
        put(store.address, after)
        seen: list[tuple[float, int, str, int]] = []

        def learnt() -> bool:
            status, body = readyz(index)
            run = cpu_run(index, "blind-node", after)
            seen.append((time.monotonic() - flushed, status, body.get("reason", ""), run))
            return run == 3 and status == 200

        wait_for(learnt, DEADLINE, interval=0.1, what="the claim lapsed and the store relearnt")
        assert any("standing by, but no replica writes it" in s[2] for s in seen), seen
        assert seen[-1][0] < 8 + 15, seen  # the intruder's hour was cut to max_claim_ttl_s
        assert cpu_run(index, "blind-node", before) == 3  # from the store's snapshot
    finally:
        engine.close()
        admin.close()
        r.close()
        index.stop()


def test_the_claim_rpc_is_for_admins() -> None:
    index = start_index()
    try:
        for who in ("engine-a", "node", "reader"):
            c = client(index, who)
            assert refused(c.claim, "x", "me", 1.0).code is ErrorCode.PERMISSION_DENIED
            c.close()
    finally:
        index.stop()


def test_readiness_recovers_once_the_source_is_followed(store: SecureStore) -> None:
    """The degraded answer is about this source: once followed, the index is ready."""
    index = start_index("--store", store.address, env={"KVTIER_INDEX__SOURCE_GRACE_S": "1"})
    try:
        keys = keys_of(6)
        put(store.address, keys)
        wait_for(lambda: cpu_run(index, "blind-node", keys) == 3, DEADLINE, what="indexed")
        time.sleep(1.5)  # past the grace: a followed source keeps it ready
        assert readyz(index)[0] == 200
    finally:
        index.stop()
