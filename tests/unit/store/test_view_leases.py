"""Engines lease pool hits themselves (``kvtier.store.client.view_leases``): a pin in the
shared lease region answers as the store's lookup would, and the store honours it: eviction
skips it, a delete keeps its pages until it goes, a session that ends takes it, and an engine
that holds the region's lock too long makes the store refuse room, never hand out pinned
pages. An embedded store and an engine-side leaser over the same segment, driven in the order
the connector does (lookup, copy, release)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.client.lease_region import ExtentMapWriter, region_shape
from kvtier.store.client.shm import SHM_DIR
from kvtier.store.client.view import open_view
from kvtier.store.client.view_leases import ViewLeaser, open_leaser, owns
from kvtier.store.node import NodeStore
from kvtier.store.server.metrics import StoreCollector
from kvtier.store.state.view_pins import HOLD_MIN_S

PAGE = 64 << 10
POOL_PAGES = 64
NS = Namespace(
    model="pins", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=PAGE, chunk_tokens=1
)


def keys(n: int, start: int = 0) -> list[bytes]:
    return prompt_keys(NS, np.arange(start, start + n, dtype=np.uint32))


@pytest.fixture
def node(store_config: StoreConfig) -> Iterator[NodeStore]:
    config = store_config.model_copy(
        update={
            "pool": store_config.pool.model_copy(
                update={"capacity": POOL_PAGES * PAGE, "eviction": "lru"}
            )
        }
    )
    store = NodeStore(config, instance="pins")
    yield store
    store.close()


def open_session(node: NodeStore) -> int:
    """A session as an engine of the node gets it: with a row of the pin table (the store
    grants one as the session opens, or on its first leased lookup or allocation)."""
    opened = node.open_session()
    node.core.grant_pin_row(opened)
    return opened


def engine(node: NodeStore) -> ViewLeaser:
    info = node.info()
    view, _ = open_view(info.segment_name, info.view_offset, info.view_bytes)
    leaser = open_leaser(info.segment_name, info.view_offset, info.view_bytes, view)
    assert leaser is not None
    return leaser


def put(node: NodeStore, ns_id: bytes, ks: list[bytes]) -> list[AllocStatus]:
    """Allocate, write (each chunk's bytes are its key, repeated) and commit, a quarter of
    the pool at a time (``store.max_batch_fraction``)."""
    statuses: list[AllocStatus] = []
    for at in range(0, len(ks), POOL_PAGES // 4):
        batch = ks[at : at + POOL_PAGES // 4]
        result = node.allocate(ns_id, batch, [PAGE] * len(batch))
        for key, location in zip(batch, result.locations, strict=True):
            if location is not None:
                for offset, length in location.extents:
                    chunk = np.resize(np.frombuffer(key, np.uint8), length)
                    node.segment.array[offset : offset + length] = chunk
        if result.lease_id:
            done = result.statuses.count(AllocStatus.ALLOCATED)
            node.commit(result.lease_id, None, [0] * done)
        statuses += result.statuses
    return statuses


def read(node: NodeStore, extents: tuple[tuple[int, int], ...]) -> bytes:
    return b"".join(bytes(node.segment.array[o : o + n]) for o, n in extents)


def test_a_leased_hit_is_answered_by_the_engine_as_the_store_would(node: NodeStore) -> None:
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(6)
    put(node, ns_id, ks[:4])
    leaser, session = engine(node), open_session(node)
    asked = node.stats()["lookups"]
    got = leaser.lookup(ns_id, ks, session, 30.0)
    assert got is not None and owns(got.lease_id) and got.stop is LookupStatus.MISS
    assert node.stats()["lookups"] == asked  # no call reached the store
    store = node.lookup(ns_id, ks)  # the store's own answer, unleased
    assert [(h.key, h.size, h.extents) for h in got.hits] == [
        (h.key, h.size, h.extents) for h in store.hits
    ]
    for hit in got.hits:  # the extents hold the chunk's bytes
        assert read(node, hit.extents) == hit.key * (PAGE // 16)
    assert node.stats()["view_pinned_chunks"] == 4
    families = {f.name: f for f in StoreCollector(node.stats).collect()}
    assert families["kvtier_store_view_pinned_chunks"].samples[0].value == 4
    assert leaser.release([got.lease_id]) == [LeaseStatus.OK]
    assert leaser.release([got.lease_id]) == [LeaseStatus.UNKNOWN]
    assert node.stats()["view_pinned_chunks"] == 0
    node.core.reap()  # the store reads the engines' hit rings: the hits count as uses
    assert node.stats()["view_hit_chunks"] == 4
    # a checksum the store computes after the commit reaches the map too
    deadline = time.monotonic() + 10
    while not all(h.checksum for h in node.lookup(ns_id, ks[:4]).hits):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    again = leaser.lookup(ns_id, ks[:4], session, 30.0)
    assert again is not None and again.stop is LookupStatus.HIT
    assert [h.checksum for h in again.hits] == [h.checksum for h in node.lookup(ns_id, ks[:4]).hits]


def test_eviction_never_takes_a_chunk_an_engine_pinned(node: NodeStore) -> None:
    ns_id = node.register_namespace(NS, PAGE)
    old = keys(POOL_PAGES)
    put(node, ns_id, old)
    leaser, session = engine(node), open_session(node)
    got = leaser.lookup(ns_id, old[:4], session, 30.0)
    assert got is not None and len(got.hits) == 4
    # two floods the size of the pool: by the second the pinned four are the coldest
    # chunks (LRU) and still stay; everything else of before goes
    put(node, ns_id, keys(POOL_PAGES, start=1000))
    put(node, ns_id, keys(POOL_PAGES, start=3000))
    assert len(node.lookup(ns_id, old[:4]).hits) == 4
    assert node.lookup(ns_id, old[4:]).hits == []
    for hit in got.hits:
        assert read(node, hit.extents) == hit.key * (PAGE // 16)
    assert leaser.release([got.lease_id]) == [LeaseStatus.OK]
    put(node, ns_id, keys(POOL_PAGES, start=5000))  # released: now they may go
    assert node.lookup(ns_id, old[:4]).hits == []
    node.core.check_invariants()


def test_a_deleted_chunk_keeps_its_pages_until_its_pin_goes(node: NodeStore) -> None:
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(4)
    put(node, ns_id, ks)
    leaser, session = engine(node), open_session(node)
    got = leaser.lookup(ns_id, ks, session, 30.0)
    assert got is not None
    assert node.delete(ns_id, ks) == 4
    # gone for everyone else at once: neither the store nor the view finds them
    assert node.lookup(ns_id, ks).hits == [] and leaser.lookup(ns_id, ks, session, 30.0) is None
    assert node.stats()["view_held_chunks"] == 4
    # but their pages are not handed out while the pin holds them
    put(node, ns_id, keys(POOL_PAGES, start=1000))
    held = {o for hit in got.hits for o, _ in hit.extents}
    fresh = [h for k in keys(POOL_PAGES, start=1000) for h in node.lookup(ns_id, [k]).hits]
    assert fresh and not held & {o for hit in fresh for o, _ in hit.extents}
    for hit in got.hits:
        assert read(node, hit.extents) == hit.key * (PAGE // 16)
    assert leaser.release([got.lease_id]) == [LeaseStatus.OK]
    time.sleep(HOLD_MIN_S)
    node.core.reap()
    stats = node.stats()
    assert stats["view_held_chunks"] == 0 and stats["doomed_bytes"] == 0
    node.core.check_invariants()


def test_a_session_that_ends_takes_its_pins(node: NodeStore) -> None:
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(4)
    put(node, ns_id, ks)
    leaser, session = engine(node), open_session(node)
    got = leaser.lookup(ns_id, ks, session, 30.0)
    assert got is not None and leaser.renew(got.lease_id, 30.0) == 30.0
    node.close_session(session)  # as when its heartbeats stop
    assert node.stats()["view_pinned_chunks"] == 0
    with pytest.raises(KvtierError) as err:
        leaser.renew(got.lease_id, 30.0)
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    assert leaser.release([got.lease_id]) == [LeaseStatus.EXPIRED]  # copies under it: suspect
    assert leaser.lookup(ns_id, ks, session, 30.0) is None  # no row: ask the store
    # its row goes to a new session only after the rows that were never used
    rows = leaser._map.rows  # type: ignore[union-attr]
    later = open_session(node)
    assert int(rows[0, 0]) == 0 and int(rows[1, 0]) == later
    put(node, ns_id, keys(POOL_PAGES, start=1000))
    assert node.lookup(ns_id, ks).hits == []


def test_an_engine_holding_the_lock_makes_the_store_refuse_room_not_reuse_pages(
    node: NodeStore,
) -> None:
    """An engine stopped while it holds the region's lock: the store does not wait for it;
    it evicts nothing and holds what it deletes until it can read the pins again."""
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(POOL_PAGES)
    put(node, ns_id, ks)
    fd = os.open(SHM_DIR / node.segment_name, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        statuses = put(node, ns_id, keys(4, start=1000))
        assert statuses == [AllocStatus.NO_SPACE] * 4
        assert node.stats()["view_lock_misses"] >= 1
        assert node.delete(ns_id, ks[:2]) == 2
        assert node.stats()["view_held_chunks"] == 2  # pins unknown: kept
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    time.sleep(HOLD_MIN_S)
    node.core.reap()
    assert node.stats()["view_held_chunks"] == 0
    assert put(node, ns_id, keys(2, start=2000)) == [AllocStatus.ALLOCATED] * 2
    node.core.check_invariants()


def test_a_read_that_never_comes_out_clean_asks_the_store(node: NodeStore) -> None:
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(4)
    put(node, ns_id, ks)
    leaser, session = engine(node), open_session(node)
    writer = node._view.writer  # type: ignore[union-attr]
    writer._begin()  # the store is mid-write (odd sequence) for as long as the reader tries
    try:
        assert leaser.lookup(ns_id, ks, session, 30.0) is None
    finally:
        writer._end()
    assert node.stats()["view_pinned_chunks"] == 0  # nothing was left pinned
    got = leaser.lookup(ns_id, ks, session, 30.0)
    assert got is not None and len(got.hits) == 4


def test_the_map_leaves_out_what_it_cannot_hold_and_says_so() -> None:
    shape = region_shape(16, pin_slots=2, pins=16, ring=16)
    words = np.zeros(shape.nbytes // 8, dtype=np.uint64)
    emap = ExtentMapWriter(words, shape, PAGE)
    emap.put(5, 1, 1, PAGE, 0, [(0, 1)])
    emap.put(6, 1, 2, 4 * PAGE, 0, [(1, 1), (3, 1), (5, 1), (7, 1)])  # more runs than it keeps
    assert emap.find(5) is not None and emap.find(6) is None and emap.unmapped == 1
    emap.drop(6)
    assert emap.unmapped == 0
    for tag in range(100, 100 + shape.map_slots):  # past its load bound: left out, counted
        emap.put(tag, 1, tag, PAGE, 0, [(0, 1)])
    assert emap.unmapped > 0 and emap.find(5) is not None


def test_the_store_bounds_an_engines_own_lease_as_its_own(store_config: StoreConfig) -> None:
    """``store.max_lease_ttl_s`` caps the TTL a lookup reports (the connector starts a load
    only well inside it) and ``store.max_lease_lifetime_s`` ends a pin held longer: the store
    clears its word, the lease answers EXPIRED, the chunk is the pool's again."""
    config = store_config.model_copy(update={"max_lease_ttl_s": 2.0, "max_lease_lifetime_s": 0.2})
    node = NodeStore(config, instance="bounds")
    try:
        ns_id = node.register_namespace(NS, PAGE)
        ks = keys(4)
        put(node, ns_id, ks)
        leaser, session = engine(node), open_session(node)
        got = leaser.lookup(ns_id, ks, session, 60.0)
        assert got is not None and got.lease_ttl_s == 2.0
        assert leaser.renew(got.lease_id, 60.0) == 2.0
        node.core.reap()  # seen now
        time.sleep(0.25)
        node.core.reap()  # held past its lifetime: cleared
        assert node.stats()["view_pins_expired"] == 4
        assert node.stats()["view_pinned_chunks"] == 0
        with pytest.raises(KvtierError):
            leaser.renew(got.lease_id, 60.0)
        assert leaser.release([got.lease_id]) == [LeaseStatus.EXPIRED]
        again = leaser.lookup(ns_id, ks, session, 60.0)  # its words are free again
        assert again is not None and leaser.release([again.lease_id]) == [LeaseStatus.OK]
    finally:
        node.close()


def test_a_session_leases_on_its_node_only_once_it_has_a_row(node: NodeStore) -> None:
    """A row is granted to a node's engine (its leased lookups and allocations through the
    store's engine surface), not to every session: a peer store's lease never takes one."""
    ns_id = node.register_namespace(NS, PAGE)
    ks = keys(2)
    put(node, ns_id, ks)
    leaser, opened = engine(node), node.open_session()
    assert leaser.lookup(ns_id, ks, opened, 30.0) is None  # no row yet: ask the store
    node.core.grant_pin_row(opened)
    got = leaser.lookup(ns_id, ks, opened, 30.0)
    assert got is not None and len(got.hits) == 2
    assert leaser.release([got.lease_id]) == [LeaseStatus.OK]
