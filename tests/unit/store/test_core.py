"""The store's state machine: allocation, eviction, leases, idempotence, bad input."""

from __future__ import annotations

import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import prompt_keys
from kvtier.store.api.events import EventGap, EventKind
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.state.core import StoreCore

from support.store_core import CHUNK, NS, PAGE, FakeClock, keys, make_core, put


def test_put_then_lookup_longest_prefix(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(5)
    assert put(core, ns_id, ks[:3]) == [AllocStatus.ALLOCATED] * 3
    result = core.lookup(ns_id, ks)
    assert [h.key for h in result.hits] == ks[:3]
    assert result.stop is LookupStatus.MISS
    assert result.lease_id == 0
    assert all(h.size == CHUNK and sum(n for _, n in h.extents) == CHUNK for h in result.hits)
    assert [h.checksum for h in result.hits] == [1, 2, 3]
    core.check_invariants()


def test_prefix_stops_at_first_gap(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(4)
    put(core, ns_id, [ks[0], ks[2], ks[3]])
    assert [h.key for h in core.lookup(ns_id, ks).hits] == [ks[0]]


def test_duplicate_put_is_idempotent(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(3)
    put(core, ns_id, ks)
    used = core.stats()["used_bytes"]
    assert put(core, ns_id, ks) == [AllocStatus.EXISTS] * 3
    assert core.stats()["used_bytes"] == used
    assert core.stats()["exists"] == 3


def test_being_written_is_pending_and_in_progress(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(2)
    alloc = core.allocate(ns_id, ks, [CHUNK, CHUNK])
    assert core.lookup(ns_id, ks).stop is LookupStatus.PENDING
    assert core.allocate(ns_id, ks, [CHUNK, CHUNK]).statuses == [AllocStatus.IN_PROGRESS] * 2
    assert core.commit(alloc.lease_id, None, [5, 6]) == 2
    assert core.lookup(ns_id, ks).stop is LookupStatus.HIT


def test_eviction_makes_room_synchronously(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(25)  # 30 pages hold 10 chunks
    for k in ks:
        assert put(core, ns_id, [k]) == [AllocStatus.ALLOCATED]
    stats = core.stats()
    assert stats["used_bytes"] <= stats["capacity_bytes"]
    assert stats["evictions"] == 15
    # LRU: the last ten survive
    assert [h.key for h in core.lookup(ns_id, ks[15:]).hits] == ks[15:]
    core.check_invariants()


def test_pinned_chunks_are_never_evicted(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(10)
    put(core, ns_id, ks)
    lease = core.lookup(ns_id, ks[:4], lease_ttl_s=60)
    assert lease.lease_id
    core.lookup(ns_id, ks)  # now the pinned chunks are the least recently used
    for k in keys(20, start=1000):
        put(core, ns_id, [k])
    assert [h.key for h in core.lookup(ns_id, ks[:4]).hits] == ks[:4]
    assert core.release([lease.lease_id]) == [LeaseStatus.OK]
    core.check_invariants()


def test_pin_committed_keeps_a_runs_cold_chunks_through_an_allocation(
    core: StoreCore, ns_id: bytes
) -> None:
    """What a disk stage or a remote fetch pins while it allocates the rest of a run: the
    run's committed chunks, the coldest in the pool, survive; nothing counts as a use."""
    run = keys(6)
    put(core, ns_id, run[3:])  # the run's tail: the pool's coldest chunks
    put(core, ns_id, keys(7, start=100))  # the pool is full (10 chunks)
    mask, pinned = core.pin_committed(ns_id, run)
    assert mask == [False] * 3 + [True] * 3
    assert put(core, ns_id, run[:3]) == [AllocStatus.ALLOCATED] * 3  # evicts three others
    core.upkeep.unpin(pinned)
    assert [h.key for h in core.lookup(ns_id, run).hits] == run
    assert core.stats()["evictions"] == 3
    core.check_invariants()


def test_full_pool_of_pinned_chunks_says_no_space(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(10)
    put(core, ns_id, ks)
    lease = core.lookup(ns_id, ks, lease_ttl_s=60)
    statuses = put(core, ns_id, keys(2, start=500))
    assert statuses == [AllocStatus.NO_SPACE] * 2
    assert [h.key for h in core.lookup(ns_id, ks).hits] == ks  # nothing was lost
    core.release([lease.lease_id])
    assert put(core, ns_id, keys(2, start=500)) == [AllocStatus.ALLOCATED] * 2
    core.check_invariants()


def test_half_written_chunks_are_never_evicted(core: StoreCore, ns_id: bytes) -> None:
    writing = core.allocate(ns_id, keys(10), [CHUNK] * 10)
    assert core.allocate(ns_id, keys(1, start=900), [CHUNK]).statuses == [AllocStatus.NO_SPACE]
    assert core.abort(writing.lease_id) == 10
    assert core.stats()["used_bytes"] == 0


def test_expired_read_lease_unpins_and_says_expired() -> None:
    clock = FakeClock()
    core = make_core(clock=clock)
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(10)
    put(core, ns_id, ks)
    lease = core.lookup(ns_id, ks, lease_ttl_s=2)
    clock.now += 3  # the reader died or stalled
    assert put(core, ns_id, keys(1, start=700)) == [AllocStatus.ALLOCATED]  # evicts a leased one
    assert core.release([lease.lease_id]) == [LeaseStatus.EXPIRED]
    assert core.stats()["expired_read"] == 1
    core.check_invariants()


def test_expired_write_lease_quarantines_then_frees_and_commit_fails() -> None:
    """The store ended the lease, not its writer: a late copy may still land in its pages,
    so they are not handed to another writer before the quarantine ends."""
    clock = FakeClock()
    core = make_core(clock=clock)
    ns_id = core.register_namespace(NS, CHUNK)
    alloc = core.allocate(ns_id, keys(2), [CHUNK, CHUNK], ttl_s=1)
    clock.now += 2
    core.reap()
    assert core.stats()["quarantined_bytes"] == core.stats()["used_bytes"] > 0
    clock.now += core.limits.ended_write_quarantine_s
    core.reap()
    assert core.stats()["used_bytes"] == 0
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, None, [1, 2])
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    assert core.lookup(ns_id, keys(2)).stop is LookupStatus.MISS


def test_renew_keeps_a_lease_alive() -> None:
    clock = FakeClock()
    core = make_core(clock=clock)
    ns_id = core.register_namespace(NS, CHUNK)
    put(core, ns_id, keys(2))
    lease = core.lookup(ns_id, keys(2), lease_ttl_s=2)
    clock.now += 1.5
    core.renew(lease.lease_id, 2)
    clock.now += 1.5
    assert core.release([lease.lease_id]) == [LeaseStatus.OK]


def test_delete_of_pinned_chunk_defers_free(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(3)
    put(core, ns_id, ks)
    lease = core.lookup(ns_id, ks, lease_ttl_s=10)
    assert core.delete(ns_id, ks) == 3
    assert core.lookup(ns_id, ks).stop is LookupStatus.MISS  # gone for new readers
    assert core.stats()["doomed_bytes"] == 3 * CHUNK  # but the reader's bytes stay put
    core.check_invariants()
    assert core.release([lease.lease_id]) == [LeaseStatus.OK]
    assert core.stats()["used_bytes"] == 0
    core.check_invariants()


def test_delete_while_writing_drops_at_commit(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(2)
    alloc = core.allocate(ns_id, ks, [CHUNK, CHUNK])
    core.delete(ns_id, ks)
    assert core.commit(alloc.lease_id, None, [1, 2]) == 0
    assert core.stats()["used_bytes"] == 0
    core.check_invariants()


def test_clear_removes_everything_and_emits_cleared(core: StoreCore, ns_id: bytes) -> None:
    put(core, ns_id, keys(4))
    assert core.clear() == 4
    assert core.lookup(ns_id, keys(4)).stop is LookupStatus.MISS
    batches = core.events.read(1)
    assert isinstance(batches, list)
    assert batches[-1].events[0].kind is EventKind.CLEARED


def test_partial_commit_keeps_the_rest_of_the_lease(core: StoreCore, ns_id: bytes) -> None:
    ks = keys(3)
    alloc = core.allocate(ns_id, ks, [CHUNK] * 3)
    assert core.commit(alloc.lease_id, ks[:1], [9]) == 1
    assert core.commit(alloc.lease_id, ks[1:], [8, 7]) == 2
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, None, [])
    assert err.value.code is ErrorCode.UNKNOWN_LEASE


# -- events ----------------------------------------------------------------------------------


def test_events_record_stores_and_evictions_in_order() -> None:
    core = make_core(pages=6)  # two chunks
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(3)
    for k in ks:
        put(core, ns_id, [k])
    batches = core.events.read(1)
    assert isinstance(batches, list)
    flat = [(e.kind, e.keys) for b in batches for e in b.events]
    assert flat == [
        (EventKind.STORED, (ks[0],)),
        (EventKind.STORED, (ks[1],)),
        (EventKind.REMOVED, (ks[0],)),
        (EventKind.STORED, (ks[2],)),
    ]
    assert [b.seq for b in batches] == [1, 2, 3, 4]
    assert all(b.node_id == "n" and b.epoch == 7 for b in batches)


def test_event_gap_then_snapshot_recovers() -> None:
    core = make_core(event_buffer=16)
    ns_id = core.register_namespace(NS, CHUNK)
    for i in range(40):
        put(core, ns_id, keys(1, start=10 * i))
    assert isinstance(core.events.read(1), EventGap)
    snap = core.snapshot()
    assert snap.seq == core.events.last_seq
    held = set(snap.chunks[ns_id])
    assert len(held) == 10 and held == {k for i in range(30, 40) for k in keys(1, start=10 * i)}
    assert core.events.read(snap.seq + 1) == []


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda c, ns: c.lookup(b"\0" * 16, keys(1)), ErrorCode.UNKNOWN_NAMESPACE),
        (lambda c, ns: c.lookup(ns, [b"short"]), ErrorCode.INVALID_ARGUMENT),
        (lambda c, ns: c.allocate(ns, keys(1), [CHUNK + 1]), ErrorCode.WRONG_SIZE),
        (lambda c, ns: c.allocate(ns, keys(2), [CHUNK]), ErrorCode.INVALID_ARGUMENT),
        (lambda c, ns: c.allocate(ns, keys(1) * 2, [CHUNK] * 2), ErrorCode.INVALID_ARGUMENT),
        (lambda c, ns: c.commit(12345, None, []), ErrorCode.UNKNOWN_LEASE),
        (lambda c, ns: c.renew(12345), ErrorCode.UNKNOWN_LEASE),
        (lambda c, ns: c.lookup(ns, keys(1), lease_ttl_s=-1), ErrorCode.INVALID_ARGUMENT),
        (lambda c, ns: c.register_namespace(NS, CHUNK * 2), ErrorCode.NAMESPACE_MISMATCH),
        (
            lambda c, ns: c.register_namespace(NS.model_copy(update={"lora": "x"}), 1 << 40),
            ErrorCode.WRONG_SIZE,
        ),
    ],
)
def test_bad_input_gets_a_clear_error(core: StoreCore, ns_id: bytes, call, code) -> None:
    put(core, ns_id, keys(2))
    before = core.stats()
    with pytest.raises(KvtierError) as err:
        call(core, ns_id)
    assert err.value.code is code
    assert err.value.message
    after = core.stats()
    assert after["chunks"] == before["chunks"] == 2  # nothing lost
    core.check_invariants()


def test_foreign_namespace_keys_answer_as_absent(core: StoreCore, ns_id: bytes) -> None:
    """Another namespace's chunks are neither read, deleted nor taken over, and nothing tells
    them from absent keys (no error names their namespace: docs/security.md)."""
    other = core.register_namespace(NS.model_copy(update={"cache_salt": "b"}), CHUNK)
    put(core, ns_id, keys(2))
    assert core.lookup(other, keys(2)).stop is LookupStatus.MISS
    assert not core.lookup(other, keys(2), lease_ttl_s=5).lease_id
    assert core.delete(other, keys(2)) == 0
    alloc = core.allocate(other, keys(3), [CHUNK] * 3)
    assert alloc.statuses == [AllocStatus.NO_SPACE] * 2 + [AllocStatus.ALLOCATED]
    core.abort(alloc.lease_id)
    assert core.committed_mask(other, keys(2)) == [False, False]
    assert core.lookup(ns_id, keys(2)).stop is LookupStatus.HIT
    core.check_invariants()


def test_commit_with_wrong_checksum_count(core: StoreCore, ns_id: bytes) -> None:
    alloc = core.allocate(ns_id, keys(2), [CHUNK] * 2)
    with pytest.raises(KvtierError) as err:
        core.commit(alloc.lease_id, None, [1])
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert core.commit(alloc.lease_id, None, [1, 2]) == 2  # the lease survived the bad call


def test_read_lease_cannot_be_committed(core: StoreCore, ns_id: bytes) -> None:
    put(core, ns_id, keys(1))
    lease = core.lookup(ns_id, keys(1), lease_ttl_s=5)
    with pytest.raises(KvtierError) as err:
        core.commit(lease.lease_id, None, [1])
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_release_of_unknown_lease(core: StoreCore) -> None:
    assert core.release([42]) == [LeaseStatus.UNKNOWN]


def test_mixed_chunk_sizes_share_the_pool_without_fragmenting() -> None:
    core = make_core(pages=64, eviction="s3fifo")
    small = core.register_namespace(NS, PAGE)  # 1 page
    big_ns = NS.model_copy(update={"num_layers": 5})
    big = core.register_namespace(big_ns, 5 * PAGE)  # 5 pages
    for i in range(200):
        ns, size, model = (small, PAGE, NS) if i % 3 else (big, 5 * PAGE, big_ns)
        k = prompt_keys(model, list(range(4 * i, 4 * i + 4)))
        result = core.allocate(ns, k, [size])
        # a put never fails while anything is evictable, whatever the holes look like
        assert result.statuses == [AllocStatus.ALLOCATED]
        core.commit(result.lease_id, None, [1])
        core.check_invariants()
    assert core.stats()["used_bytes"] <= 64 * PAGE
