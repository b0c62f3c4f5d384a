"""Drills of the index on a real Redis Cluster (3 masters, a replica each): a master killed
while its replica lacks the newest writes, and a shard's slot migrated to another master.

Throughout, a reader queries without pause and every answer must be DEGRADED or name no
location for a chunk it no longer holds (an acknowledged removal); health is DEGRADED while the
shard is unserved; afterwards the writer's next apply answers RESYNC, it replaces its state,
and answers are whole again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from redis.crc import key_slot

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, chunk_keys
from kvtier.index.api import (
    ApplyStatus,
    ChunkOp,
    IndexHealth,
    LocationKind,
    Query,
    Registration,
)
from kvtier.index.backends.redis_cluster import PLACEMENTS, Placement, RedisClusterIndex
from kvtier.store.api.events import EventKind
from kvtier.testing.redis_cluster import LocalRedisCluster, start_redis_cluster

NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=16
)
CHUNKS = 40


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    cluster = start_redis_cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


class Reader(threading.Thread):
    """Queries the prompt without pause; records every answer's health and i0's run, and
    what the index said of its own health (readiness) each time."""

    def __init__(self, index: RedisClusterIndex, ns_id: bytes, keys: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.index, self.query = index, Query(ns_id, keys=keys)
        self.answers: list[tuple[IndexHealth, int]] = []
        self.readiness: list[IndexHealth] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            result = self.index.query([self.query])[0]
            held = result.of("i0")
            self.answers.append((result.health, held.total if held else 0))
            self.readiness.append(self.index.health()[0])
            time.sleep(0.002)

    def stop(self) -> list[tuple[IndexHealth, int]]:
        self.halt.set()
        self.join(timeout=30)
        return self.answers


def setup(
    cluster: LocalRedisCluster, placement: Placement = "namespace"
) -> tuple[RedisClusterIndex, bytes, list[bytes], int]:
    """The index, the prompt (held whole by i0) and the slot of the shard that holds its
    chunk 10, the first of the drills' removal (with placement ``chunk`` the other shards hold
    the rest of it: their answers alone would not cut the run at 10)."""
    index = RedisClusterIndex(cluster.url, prefix="drill:", shards=3, placement=placement)
    ns_id = index.register_namespace(NS)
    index.register(Registration("i0", LocationKind.INSTANCE, (ns_id,), node="n0"))
    keys = chunk_keys(ns_id, np.arange(CHUNKS * 16), 16)
    index.replace("i0", {Tier.GPU: {ns_id: keys}}, epoch=1, seq=1)
    slot = key_slot(index._shards[index.shard_of(ns_id, keys[10])]._p)
    return index, ns_id, keys, slot


def removal(ns_id: bytes, keys: list[bytes]) -> ChunkOp:
    return ChunkOp(EventKind.REMOVED, Tier.GPU, ns_id, tuple(keys))


def resync_and_check(index: RedisClusterIndex, ns_id: bytes, keys: list[bytes], held: int) -> None:
    """The writer's next batch answers RESYNC (its cursor was taken down with the shard); it
    replaces its state, and the answer is whole and healthy again."""
    deadline = time.monotonic() + 30
    while index.health()[0] is not IndexHealth.OK:
        assert time.monotonic() < deadline, index.health()
        time.sleep(0.1)
    status = index.apply("i0", [], epoch=1, seq_from=3, seq_to=3)
    assert status is ApplyStatus.RESYNC
    index.replace("i0", {Tier.GPU: {ns_id: keys[:held]}}, epoch=1, seq=3)
    result = index.query([Query(ns_id, keys=keys)])[0]
    assert result.health is IndexHealth.OK
    assert result.of("i0") is not None and result.of("i0").total == held  # type: ignore[union-attr]
    assert index.backend_resets().resets >= 1


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_failover_that_lost_a_removal_never_names_the_old_holder(
    cluster: LocalRedisCluster, placement: Placement
) -> None:
    """The replica is paused while the writer removes the prompt's tail (acknowledged by the
    master, never replicated); the master is killed; the promoted replica still holds the
    tail. The index takes the shard's locations down before answering from it."""
    index, ns_id, keys, slot = setup(cluster, placement)
    try:
        master = cluster.master_of(slot)
        replicas = [n for n in cluster.live() if n is not master and n not in cluster.masters()]
        replica = next(n for n in replicas if _replica_of(n) == master.port)
        reader = Reader(index, ns_id, keys)
        reader.start()
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            status = index.apply("i0", [removal(ns_id, keys[10:])], epoch=1, seq_from=2, seq_to=2)
            assert status is ApplyStatus.APPLIED
            removed_at = len(reader.answers)
            cluster.kill(master)  # before the replica hears of the removal
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert cluster.wait_for_new_master(slot, master) is replica
        deadline = time.monotonic() + 30
        while index.health()[0] is not IndexHealth.OK:
            assert time.monotonic() < deadline, index.health()
            time.sleep(0.05)
        answers = reader.stop()
    finally:
        reader.halt.set()
    after = answers[removed_at + 1 :]
    wrong = [a for a in after if a[0] is IndexHealth.OK and a[1] > 10]
    assert not wrong, f"{len(wrong)} answers named i0 for chunks it had removed"
    assert any(h is IndexHealth.DEGRADED for h, _ in after)  # the outage was said
    assert IndexHealth.DEGRADED in reader.readiness[removed_at:]  # and readiness said so
    resync_and_check(index, ns_id, keys, 10)
    index.close()


def test_resharded_slot_is_taken_down_then_resynced(cluster: LocalRedisCluster) -> None:
    """The shard's slot moves to another master with its keys while the reader reads: every
    answer is DEGRADED or right, and after the move the writer resyncs."""
    index, ns_id, keys, slot = setup(cluster)
    reader = Reader(index, ns_id, keys)
    reader.start()
    try:
        source = cluster.master_of(slot)
        target = next(m for m in cluster.masters() if m is not source)
        cluster.move_slot(slot, target)
        time.sleep(0.3)
        index.health()  # the health check notices the move as readiness probes would
        answers = reader.stop()
    finally:
        reader.halt.set()
    assert all(h is IndexHealth.DEGRADED or held in (0, CHUNKS) for h, held in answers)
    assert cluster.master_of(slot) is target
    resync_and_check(index, ns_id, keys, CHUNKS)
    index.close()


def _replica_of(node) -> int:  # type: ignore[no-untyped-def]
    """The port of the master ``node`` replicates (0 for a master)."""
    with node.client() as c:
        role = c.execute_command("ROLE")
    return int(role[2]) if role[0] == b"slave" else 0
