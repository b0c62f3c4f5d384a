"""Following vLLM KV events over real ZMQ sockets: vLLM's own publisher for the normal life,
a wire-exact publisher (tests/support/vllm_fixtures.py) for the faults (gaps, lost tails,
restarts, garbage) that a healthy engine does not produce on demand; last, index replicas
sharing one Redis."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvtier.core.chunks import Tier
from kvtier.core.config.index import IndexConfig, VllmSource
from kvtier.core.keys import Namespace
from kvtier.index.api import LocationStatus, Query
from kvtier.index.backends.redis import RedisIndex
from kvtier.index.server.service import EmbeddedIndex

from support.helpers import RedisServer, free_port
from support.vllm_fixtures import FaultyPublisher, wait_for

BS = 16
NS = Namespace(
    model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_size=32, chunk_tokens=64
)
NS_ID = NS.root_key()
FAST = {"probe_interval_s": 0.2, "replay_timeout_s": 1.0, "claim_ttl_s": 0.8}


def prompt(seed: int, chunks: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(chunks * NS.chunk_tokens)]


_hash = iter(range(1, 1 << 60))


def stored(tokens: list[int], parent: int | None = None) -> tuple[BlockStored, list[int]]:
    hashes = [next(_hash) for _ in range(len(tokens) // BS)]
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
        lora_id=None, medium="GPU", lora_name=None, group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    return event, hashes


def held(index, tokens: list[int], location: str = "eng") -> int:
    holding = index.query_one(Query(NS_ID, tokens=tokens)).of(location)
    return holding.runs.get(Tier.GPU, 0) if holding else 0


def source(port: int, replay: int | None) -> VllmSource:
    return VllmSource(
        instance="eng",
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}" if replay else None,
        topic="kv",
        namespaces=[NS],
        node="node-1",
    )


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def publisher(ports: tuple[int, int]) -> Iterator[FaultyPublisher]:
    pub = FaultyPublisher(*ports)
    yield pub
    pub.close()


def embedded(ports: tuple[int, int], replay: bool = True, **kw) -> EmbeddedIndex:
    settings = {**FAST, **kw}
    return EmbeddedIndex(
        IndexConfig(vllm=[source(ports[0], ports[1] if replay else None)], **settings)
    )


def stats(index: EmbeddedIndex) -> dict:
    (s,) = index.ingest.sources()
    return s.snapshot()


def test_vllm_publisher_late_index_live_updates_and_clear(ports: tuple[int, int]) -> None:
    """vLLM's ZmqEventPublisher: the index starts after three batches, then follows."""
    pub = ZmqEventPublisher(
        0, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", topic="kv"
    )
    index = None
    try:
        a, b = prompt(1), prompt(2)
        ev_a, hashes_a = stored(a)
        pub.publish(KVEventBatch(ts=time.time(), events=[ev_a]))
        pub.publish(KVEventBatch(ts=time.time(), events=[stored(prompt(3))[0]]))
        pub.publish(KVEventBatch(ts=time.time(), events=[]))
        time.sleep(0.2)  # published before anyone listened
        index = embedded(ports)
        wait_for(lambda: held(index, a) == 3, what="catch-up by replay")
        ev_b, _ = stored(b)
        middle = BlockRemoved(block_hashes=[hashes_a[5]], medium="GPU", group_idx=0)
        pub.publish(KVEventBatch(ts=time.time(), events=[ev_b, middle]))
        wait_for(lambda: held(index, b) == 3 and held(index, a) == 1, what="live batch")
        result = index.query_one(Query(NS_ID, tokens=b))
        assert result.of("eng").node == "node-1" and result.num_chunks == 3
        pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        wait_for(lambda: held(index, b) == 0 and held(index, a) == 0, what="cleared")
        s = stats(index)
        assert s["gaps_lost"] == 0 and s["batches"] == 5 and s["state"] == "live"
        assert s["events"] == {"BlockStored": 3, "BlockRemoved": 1, "AllBlocksCleared": 1}
    finally:
        if index is not None:
            index.close()
        pub.shutdown()


def test_gap_recovered_by_replay(ports, publisher: FaultyPublisher) -> None:
    index = embedded(ports)
    try:
        wait_for(lambda: stats(index)["state"] == "live", what="follower live")
        prompts = [prompt(10 + i) for i in range(3)]
        for i, tokens in enumerate(prompts):
            publisher.publish([stored(tokens)[0]], drop_live=i == 1)
        wait_for(lambda: all(held(index, p) == 3 for p in prompts), what="all three")
        s = stats(index)
        assert s["gaps_recovered"] == 1 and s["gaps_lost"] == 0
    finally:
        index.close()


def test_gap_beyond_the_buffer_is_lost_and_the_rest_applies(ports, publisher) -> None:
    index = embedded(ports)
    try:
        wait_for(lambda: stats(index)["state"] == "live", what="follower live")
        prompts = [prompt(20 + i) for i in range(3)]
        for i, tokens in enumerate(prompts):
            publisher.publish([stored(tokens)[0]], drop_live=i == 1, forget=i == 1)
        wait_for(lambda: held(index, prompts[2]) == 3, what="batch after the gap")
        assert held(index, prompts[0]) == 3 and held(index, prompts[1]) == 0
        assert stats(index)["gaps_lost"] == 1
    finally:
        index.close()


def test_lost_tail_found_by_the_probe(ports, publisher) -> None:
    index = embedded(ports)
    try:
        first, last = prompt(30), prompt(31)
        publisher.publish([stored(first)[0]])
        wait_for(lambda: held(index, first) == 3, what="first batch")
        publisher.publish([stored(last)[0]], drop_live=True)  # nothing after it reveals the gap
        wait_for(lambda: held(index, last) == 3, what="the probe's replay")
    finally:
        index.close()


def test_engine_restart_is_detected_idle_or_busy(ports) -> None:
    old = FaultyPublisher(*ports)
    index = embedded(ports)
    try:
        a = prompt(40)
        for i in range(3):
            old.publish([stored(a if i == 0 else prompt(41 + i))[0]])
        wait_for(lambda: held(index, a) == 3, what="old engine's blocks")
        old.close()
        new = FaultyPublisher(*ports)  # a new engine on the same ports: seq from 0, empty cache
        try:
            wait_for(lambda: held(index, a) == 0, what="idle restart noticed by the probe")
            assert stats(index)["restarts"] == 1
            c = prompt(50)
            new.publish([stored(c)[0]])
            wait_for(lambda: held(index, c) == 3, what="the new engine's blocks")
        finally:
            new.close()
    finally:
        index.close()


def test_restart_without_replay_socket_seen_from_sequence_numbers(ports) -> None:
    old = FaultyPublisher(ports[0], None)
    index = embedded(ports, replay=False)
    try:
        time.sleep(0.3)  # SUB connected
        a = prompt(60)
        for i in range(4):
            old.publish([stored(a if i == 0 else prompt(61 + i))[0]])
        wait_for(lambda: held(index, a) == 3, what="first engine")
        old.close()
        new = FaultyPublisher(ports[0], None)
        try:
            time.sleep(0.5)  # SUB reconnected
            c = prompt(70)
            new.publish([stored(c)[0]])
            wait_for(lambda: held(index, c) == 3 and held(index, a) == 0, what="restart by seq")
            assert stats(index)["restarts"] == 1
        finally:
            new.close()
    finally:
        index.close()


def test_bad_input_is_skipped_and_counted(ports, publisher) -> None:
    index = embedded(ports)
    try:
        wait_for(lambda: stats(index)["state"] == "live", what="follower live")
        good = prompt(80)
        publisher.publish([stored(good)[0]])
        wait_for(lambda: held(index, good) == 3, what="a good batch")
        topic = publisher.topic
        publisher.send_raw([topic, b"\x00"])  # two frames
        publisher.send_raw(
            [topic, (1).to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [], 0])]
        )
        # one batch: an unknown event type, a malformed one and a valid one
        mixed = prompt(81)
        ev, _ = stored(mixed)
        payload = msgspec.msgpack.encode(
            [
                time.time(),
                [{"type": "BlockTeleported"}, {"type": "BlockStored", "block_hashes": "x"}, ev],
                0,
            ]
        )
        with publisher._lock:
            seq = publisher.seq
            publisher.seq += 1
            publisher.buffer.append((seq, payload))
        publisher.send_raw([topic, seq.to_bytes(8, "big"), payload])
        publisher.send_raw([topic, (seq + 1).to_bytes(8, "big"), b"\xc1not msgpack"])
        with publisher._lock:
            publisher.seq += 1
        wait_for(lambda: held(index, mixed) == 3, what="the valid event of the mixed batch")
        after = prompt(82)
        publisher.publish([stored(after)[0]])
        wait_for(lambda: held(index, after) == 3, what="batches after the garbage")
        s = stats(index)
        assert s["rejected"]["bad_frames"] == 1
        assert s["rejected"]["duplicate"] == 1  # seq 1 again, older than what we applied
        assert s["rejected"]["malformed_event"] == 2
        assert s["rejected"]["malformed_batch"] == 1
        assert s["gaps_lost"] == 0 and s["state"] == "live"
        assert held(index, good) == 3
    finally:
        index.close()


def test_silent_engine_is_dropped_and_relearned_when_back(ports) -> None:
    pub = FaultyPublisher(*ports)
    index = embedded(ports, heartbeat_timeout_s=1.0)
    try:
        a = prompt(90)
        pub.publish([stored(a)[0]])
        wait_for(lambda: held(index, a) == 3, what="engine's blocks")
        time.sleep(1.5)  # probes keep an idle engine alive
        assert held(index, a) == 3
        pub.close()  # the engine is gone: no events, no probe answers
        wait_for(
            lambda: index.locations()[0].status is LocationStatus.DOWN, timeout=10, what="reaped"
        )
        assert held(index, a) == 0
        pub = FaultyPublisher(*ports)  # it comes back (restarted, empty)
        pub.publish([stored(a)[0]])
        wait_for(lambda: held(index, a) == 3, what="re-learned")
        assert index.locations()[0].status is LocationStatus.UP
    finally:
        index.close()
        pub.close()


def test_late_index_learns_what_the_engine_still_buffers(ports) -> None:
    pub = FaultyPublisher(*ports, buffer=2)
    try:
        prompts = [prompt(100 + i) for i in range(4)]
        for tokens in prompts:
            pub.publish([stored(tokens)[0]])
        index = embedded(ports)
        try:
            wait_for(lambda: held(index, prompts[3]) == 3, what="buffered batches")
            assert [held(index, p) for p in prompts] == [0, 0, 3, 3]
            assert stats(index)["gaps_lost"] == 2
        finally:
            index.close()
    finally:
        pub.close()


def test_redis_replicas_share_one_writer_and_outlive_the_index(
    ports, publisher, redis_server: RedisServer
) -> None:
    prefix = f"t:{uuid.uuid4().hex[:8]}:"

    def replica(name: str) -> EmbeddedIndex:
        config = IndexConfig(
            backend="redis", redis_url=redis_server.url, redis_prefix=prefix, replica_id=name,
            vllm=[source(*ports)], **FAST,
        )  # fmt: skip
        return EmbeddedIndex(config)

    r1 = replica("r1")
    wait_for(lambda: stats(r1)["state"] == "live", what="r1 writes")
    r2 = replica("r2")
    try:
        a = prompt(110)
        publisher.publish([stored(a)[0]])
        wait_for(lambda: held(r1, a) == 3 and held(r2, a) == 3, what="both replicas answer")
        wait_for(lambda: stats(r2)["state"] == "standby", what="r2 stands by")
        r1.close()  # the writer goes away: r2 takes over once r1's claim lapses
        b = prompt(111)
        publisher.publish([stored(b)[0]])
        wait_for(lambda: held(r2, b) == 3, what="r2 took over")
        wait_for(lambda: stats(r2)["state"] == "live", what="r2 live")
    finally:
        r2.close()
    # no index process at all: Redis still holds the answers
    with RedisIndex(redis_server.url, prefix) as bare:
        assert held(bare, a) == 3 and held(bare, b) == 3
        bare.flush()
