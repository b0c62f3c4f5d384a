"""The index's change feed and a router's replica of the index (index/server/feed.py,
index/client/replica.py), in this process: the replica is driven step by step
(``sync_once``), as its follower thread drives it, and must answer every query as the index
does once it applied the feed; a gap or another feed epoch makes it load a snapshot again.
Across a real index process: tests/integration/security/test_index_replica.py."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.core.chunks import Tier
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import (
    ChunkIndex,
    ChunkOp,
    ForwardingIndex,
    LocationKind,
    Query,
    Registration,
)
from kvtier.index.backends.memory import MemoryIndex
from kvtier.index.client import feed_wire
from kvtier.index.client.changes import ChangeKind
from kvtier.index.client.replica import IndexReplica
from kvtier.index.server.feed import ChangeFeed, FeedingIndex
from kvtier.store.api.events import EventKind

STORED, REMOVED, CLEARED = EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED
INSTANCE = LocationKind.INSTANCE
NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=16
)
PROMPTS = [list(range(i, i + 16 * 12)) for i in (0, 1000)]


def _seen(index: ChunkIndex) -> list[list[tuple[str, dict, int]]]:
    """What routing reads of each prompt: who holds which run in which tier."""
    results = index.query([Query(NS.root_key(), keys=prompt_keys(NS, p)) for p in PROMPTS])
    return [[(h.location, dict(h.runs), h.total) for h in r.holdings] for r in results]


def _writes(index: ChunkIndex) -> None:
    """Every kind of write: namespaces, registrations, ops of each kind, replace, drop."""
    ns_id = index.register_namespace(NS)
    a, b = (prompt_keys(NS, p) for p in PROMPTS)
    for name, kind in (("i0", INSTANCE), ("n0", LocationKind.NODE), ("i1", INSTANCE)):
        index.register(Registration(name, kind, node="n0"))
    index.apply("i0", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(a[:8]))])
    index.apply("n0", [ChunkOp(STORED, Tier.CPU, ns_id, tuple(a + b))])
    index.apply("n0", [ChunkOp(REMOVED, Tier.CPU, ns_id, tuple(b[5:]))])
    index.apply("i1", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(b[:3]))])
    index.apply("i1", [ChunkOp(CLEARED, None, ns_id)])
    index.replace("i1", {Tier.GPU: {ns_id: a[:2]}}, epoch=3, seq=9)
    index.heartbeat(["i0", "n0", "nobody"])
    index.register(Registration("gone", INSTANCE))
    index.apply("gone", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(a))])
    index.unregister("gone")
    index.register(Registration("down", INSTANCE))
    index.apply("down", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(b))])
    index.drop("down")


def _caught_up(replica: IndexReplica, source: FeedingIndex) -> None:
    for _ in range(100):
        replica.sync_once()
        if replica.epoch == source.feed.epoch and replica.seq == source.feed.last:
            return
    raise AssertionError("the replica never caught up")


def test_a_replica_following_the_feed_answers_as_the_index() -> None:
    source = FeedingIndex(MemoryIndex(), ChangeFeed())
    replica = IndexReplica(source, start=False)
    replica.sync_once()  # the snapshot of an empty index
    assert replica.snapshots == 1 and replica.fresh()
    _writes(source)
    _caught_up(replica, source)
    assert replica.fresh() and replica.snapshots == 1  # followed, not reloaded
    assert _seen(replica.copy) == _seen(source) and _seen(replica) == _seen(source)
    assert any(held for held in _seen(source))  # the prompts are held: the check can fail
    assert {i.registration.location for i in replica.copy.locations()} == {"i0", "n0", "i1", "down"}
    assert replica.copy.namespace(NS.root_key()) == (True, NS)


def test_a_snapshot_taken_mid_way_then_the_feed_gives_the_same_index() -> None:
    source = FeedingIndex(MemoryIndex(), ChangeFeed())
    _writes(source)  # before the replica exists: its snapshot carries them
    replica = IndexReplica(source, start=False)
    ns_id = NS.root_key()
    keys = prompt_keys(NS, PROMPTS[1])
    _caught_up(replica, source)
    source.apply("i0", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(keys))])
    _caught_up(replica, source)
    assert _seen(replica.copy) == _seen(source)


@pytest.mark.parametrize("feed", [ChangeFeed(capacity=4), ChangeFeed(max_keys=16)])
def test_a_replica_past_what_the_feed_keeps_loads_a_snapshot_again(feed: ChangeFeed) -> None:
    """The feed keeps a bounded number of changes and of chunk keys in them."""
    source = FeedingIndex(MemoryIndex(), feed)
    replica = IndexReplica(source, start=False)
    replica.sync_once()
    _writes(source)  # more than 4 changes: the first ones are gone from the ring
    replica.sync_once()  # a gap
    assert replica.epoch == ""
    _caught_up(replica, source)
    assert replica.snapshots == 2
    assert _seen(replica.copy) == _seen(source)


def test_an_index_restart_is_another_epoch_and_a_reload() -> None:
    source = FeedingIndex(MemoryIndex(), ChangeFeed())
    _writes(source)
    replica = IndexReplica(source, start=False)
    _caught_up(replica, source)
    # the index restarted: an empty backend, a new feed; the replica must not keep the old
    restarted = FeedingIndex(MemoryIndex(), ChangeFeed())
    restarted.register_namespace(NS)
    replica.feed = restarted
    replica.inner = restarted
    _caught_up(replica, restarted)
    assert replica.snapshots == 2
    assert _seen(replica.copy) == [[], []]


def test_a_stale_replica_sends_queries_to_the_index() -> None:
    source = FeedingIndex(MemoryIndex(), ChangeFeed())
    replica = IndexReplica(source, max_stale_s=0.2, start=False)
    _writes(source)
    _caught_up(replica, source)
    ns_id = NS.root_key()
    source.apply("i0", [ChunkOp(STORED, Tier.GPU, ns_id, tuple(prompt_keys(NS, PROMPTS[1])))])
    assert replica.fresh() and _seen(replica) != _seen(source)  # fresh enough: the copy
    time.sleep(0.3)  # no contact with the feed for longer than max_stale_s
    assert not replica.fresh() and _seen(replica) == _seen(source)  # the index itself


def test_an_index_without_a_feed_says_why() -> None:
    class Opaque(ForwardingIndex):  # a backend that cannot dump itself (as Redis)
        pass

    source = FeedingIndex(Opaque(MemoryIndex()), ChangeFeed())
    replica = IndexReplica(source, start=False)
    with pytest.raises(KvtierError) as caught:
        replica.sync_once()
    assert caught.value.code is ErrorCode.UNSUPPORTED
    assert "share a Redis" in caught.value.message


def test_changes_and_snapshot_parts_survive_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    source = FeedingIndex(MemoryIndex(), ChangeFeed())
    _writes(source)
    batch = source.follow("", 0)
    assert batch.gap  # no epoch yet: load a snapshot first
    batch = source.follow(source.feed.epoch, 0, limit=1000)
    decoded = feed_wire.batch_from_pb(feed_wire.batch_to_pb(batch))
    assert decoded == batch
    monkeypatch.setattr(feed_wire, "PART_ENTRIES", 5)  # a location across several parts
    dump = source.snapshot()
    parts = feed_wire.dump_to_parts(dump, "s1")
    assert len(parts) > 3
    back = feed_wire.dump_from_parts(iter(parts))
    assert (back.epoch, back.seq, back.namespaces) == (dump.epoch, dump.seq, dump.namespaces)
    assert {d.info.registration.location: d.entries for d in back.locations} == {
        d.info.registration.location: d.entries for d in dump.locations
    }


def test_a_reader_that_is_current_hears_the_next_change_as_it_comes() -> None:
    feed = ChangeFeed()
    later = threading.Timer(0.05, lambda: feed.append(ChangeKind.DROP, location="x"))
    later.start()
    batch = feed.read(feed.epoch, 0, 10, wait_s=30)  # woken by the change, not the timeout
    later.join()
    assert [(c.seq, c.location) for c in batch.changes] == [(1, "x")] and batch.last == 1
