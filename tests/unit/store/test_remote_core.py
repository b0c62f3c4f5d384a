"""Store-core support for the remote tier: quarantined aborts, cold-chunk candidates for
demotion, side-effect-free presence checks, checksums recorded for leased chunks."""

from __future__ import annotations

import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api.types import AllocStatus

from support.store_core import CHUNK, NS, PAGE, FakeClock, keys, make_core, put


def test_quarantined_pages_are_not_reused_until_the_quarantine_ends() -> None:
    clock = FakeClock()
    core = make_core(pages=6, clock=clock)  # room for exactly two chunks
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(2)
    alloc = core.allocate(ns_id, ks, [CHUNK, CHUNK], ttl_s=60)  # ks[1] stays being written
    assert core.abort(alloc.lease_id, ks[:1], quarantine_s=5) == 1
    stats = core.stats()
    assert stats["quarantined_bytes"] == CHUNK and stats["writing_bytes"] == CHUNK
    assert core.lookup(ns_id, ks[:1]).stop is LookupStatus.MISS  # the key is gone at once
    core.check_invariants()
    # The key can be allocated again, but not into the quarantined pages: no room left.
    again = core.allocate(ns_id, ks[:1], [CHUNK])
    assert again.statuses == [AllocStatus.NO_SPACE]
    clock.now += 4.9
    core.reap()
    assert core.stats()["quarantined_bytes"] == CHUNK
    clock.now += 0.2
    again = core.allocate(ns_id, ks[:1], [CHUNK])  # allocation reaps first
    assert again.statuses == [AllocStatus.ALLOCATED]
    assert core.stats()["quarantined_bytes"] == 0
    assert core.stats()["quarantine_released"] == 1
    core.check_invariants()


def test_quarantine_keeps_its_pages_out_of_every_allocation() -> None:
    clock = FakeClock()
    core = make_core(pages=12, clock=clock)
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(4)
    alloc = core.allocate(ns_id, ks, [CHUNK] * 4)
    dirty = {loc.extents for loc in alloc.locations if loc is not None}
    core.abort(alloc.lease_id, None, quarantine_s=3)
    assert core.stats()["quarantined_bytes"] == 4 * CHUNK
    # Nothing can be allocated (all pages quarantined), and eviction cannot free them.
    assert core.allocate(ns_id, keys(1, 100), [CHUNK]).statuses == [AllocStatus.NO_SPACE]
    clock.now += 3
    fresh = core.allocate(ns_id, keys(4, 100), [CHUNK] * 4)
    assert all(s is AllocStatus.ALLOCATED for s in fresh.statuses)
    assert {loc.extents for loc in fresh.locations if loc} == dirty  # reused only now
    core.check_invariants()


def test_abort_without_quarantine_frees_at_once() -> None:
    core = make_core(pages=6)
    ns_id = core.register_namespace(NS, CHUNK)
    alloc = core.allocate(ns_id, keys(2), [CHUNK, CHUNK])
    core.abort(alloc.lease_id, None, quarantine_s=0)
    assert core.stats()["used_bytes"] == 0


def test_bad_quarantine_is_refused() -> None:
    core = make_core()
    ns_id = core.register_namespace(NS, CHUNK)
    alloc = core.allocate(ns_id, keys(1), [CHUNK])
    with pytest.raises(KvtierError) as err:
        core.abort(alloc.lease_id, None, quarantine_s=-1)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_clear_leaves_quarantined_pages_quarantined() -> None:
    clock = FakeClock()
    core = make_core(pages=6, clock=clock)
    ns_id = core.register_namespace(NS, CHUNK)
    alloc = core.allocate(ns_id, keys(1), [CHUNK])
    core.abort(alloc.lease_id, None, quarantine_s=2)
    core.clear()
    assert core.stats()["quarantined_bytes"] == CHUNK
    clock.now += 2
    core.reap()
    assert core.stats()["used_bytes"] == 0
    core.check_invariants()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_coldest_is_what_eviction_takes_and_skips_pinned(eviction: str) -> None:
    core = make_core(pages=30, eviction=eviction)
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(6)
    for key in ks:
        put(core, ns_id, [key])
    core.lookup(ns_id, ks[:1])  # touch chunk 0: hot
    lease = core.lookup(ns_id, ks[1:2], lease_ttl_s=10)  # chunk 1 pinned
    cold = [key for _, key, _ in core.upkeep.coldest(4 * CHUNK)]
    assert len(cold) == 4
    assert ks[1] not in cold  # pinned chunks are never candidates
    assert ks[0] not in cold  # the hot one comes last
    assert core.upkeep.coldest(CHUNK - 1) == []  # budget smaller than one chunk
    before = core.stats()
    core.upkeep.coldest(30 * PAGE)
    assert core.stats() == before  # nothing changed
    # Eviction takes candidates in the same order.
    core.release([lease.lease_id])
    core.allocate(ns_id, keys(6, 100), [CHUNK] * 6)  # needs 4 evictions (pool is 10 chunks)
    gone = [k for k in ks if core.lookup(ns_id, [k]).stop is LookupStatus.MISS]
    assert set(gone) <= set(cold) | {ks[1]}


def test_committed_mask_has_no_side_effects() -> None:
    core = make_core()
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(3)
    put(core, ns_id, ks[:1])
    alloc = core.allocate(ns_id, ks[1:2], [CHUNK])
    before = core.stats()
    assert core.committed_mask(ns_id, ks) == [True, False, False]
    assert core.stats() == before
    core.abort(alloc.lease_id)


def test_checksums_recorded_for_a_read_lease() -> None:
    core = make_core()
    ns_id = core.register_namespace(NS, CHUNK)
    ks = keys(2)
    alloc = core.allocate(ns_id, ks, [CHUNK, CHUNK])
    core.commit(alloc.lease_id, None, [0, 5])  # first without a checksum
    lease = core.lookup(ns_id, ks, lease_ttl_s=5)
    entries = core.upkeep.read_lease_entries(lease.lease_id)
    assert [e.checksum for e in entries] == [0, 5]
    core.upkeep.record_checksums([(entries[0], 77), (entries[1], 99)])  # never overwrites one set
    assert [core.upkeep.location_of(e).checksum for e in entries] == [77, 5]
    with pytest.raises(KvtierError):
        core.upkeep.read_lease_entries(alloc.lease_id)  # not a read lease (and gone)
