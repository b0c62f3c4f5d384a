"""Session-bound leases: a client's leases end with its session, so a killed engine frees its
pins in seconds, not at its leases' TTL.

The state machine (fake clock): a session ends by close or by a missed heartbeat, and takes
its read leases (unpinned) and write leases (aborted) with it. Over gRPC, ``GrpcStoreClient``
running its session by itself: tests/integration/test_store_sessions_grpc.py; the drill (a
real client process holding long leases, SIGKILLed): tests/drills/test_killed_client.py.
"""

from __future__ import annotations

import pytest

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.state.core import StoreCore
from kvtier.store.state.limits import StoreLimits

PAGE = 4096
NS = Namespace(
    model="sessions", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(n: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    return prompt_keys(ns, list(range(4 * start, 4 * (start + n))))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def core(clock: FakeClock) -> StoreCore:
    return StoreCore(
        node_id="n",
        epoch=1,
        capacity_bytes=16 * PAGE,
        page_size=PAGE,
        eviction="lru",
        lease_ttl_s=300,
        write_ttl_s=300,
        clock=clock,
        limits=StoreLimits(session_timeout_s=5, max_sessions=3),
    )


def committed(core: StoreCore, ns_id: bytes, n: int) -> list[bytes]:
    ks = keys(n, start=1000)
    result = core.allocate(ns_id, ks, [PAGE] * n)
    core.commit(result.lease_id, None, [1] * n)
    return ks


def test_a_session_that_misses_its_heartbeat_takes_its_leases(
    core: StoreCore, clock: FakeClock
) -> None:
    ns_id = core.register_namespace(NS, PAGE)
    held = committed(core, ns_id, 3)
    session = core.open_session()
    read = core.lookup(ns_id, held, lease_ttl_s=300, session=session).lease_id
    write = core.allocate(ns_id, keys(2), [PAGE] * 2, session=session).lease_id
    other = core.lookup(ns_id, held, lease_ttl_s=300).lease_id  # no session: TTL only
    for _ in range(4):  # heartbeats keep it alive well past the timeout
        clock.now += 4
        assert core.heartbeat(session)
    core.reap()
    assert core.stats()["read_leases"] == 2 and core.stats()["write_leases"] == 1
    clock.now += 5.1  # silence: the client is gone
    core.reap()
    stats = core.stats()
    assert stats["read_leases"] == 1 and stats["write_leases"] == 0
    assert stats["writing_bytes"] == 0 and stats["sessions"] == 0
    assert stats["quarantined_bytes"] == 2 * PAGE  # a late copy may still land there
    assert stats["sessions_expired"] == 1
    assert stats["session_released_read"] == 1 and stats["session_released_write"] == 1
    assert not core.heartbeat(session)  # the client must open a new one
    assert core.release([read]) == [LeaseStatus.EXPIRED]  # what it copied may be torn
    with pytest.raises(KvtierError) as err:
        core.commit(write, None, [1, 1])
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    assert core.release([other]) == [LeaseStatus.OK]
    core.check_invariants()


def test_pages_of_a_write_lease_its_session_took_are_not_handed_to_another_writer(
    core: StoreCore, clock: FakeClock
) -> None:
    """The store ended the session (a frozen store, a starved heartbeat thread), not the
    writer: its copy may still land. Until the quarantine ends another writer gets other
    pages, or none, so the late copy cannot be checksummed into that writer's chunk."""
    ns_id = core.register_namespace(NS, PAGE)
    session = core.open_session()
    first = core.allocate(ns_id, keys(4), [PAGE] * 4, session=session)
    pages = {loc.extents for loc in first.locations if loc is not None}
    clock.now += 5.1  # no heartbeat: the session ends, its write lease with it
    core.reap()
    assert core.stats()["quarantined_bytes"] == 4 * PAGE
    others = core.allocate(ns_id, keys(12, start=100), [PAGE] * 12)  # the rest of the pool
    assert all(s is AllocStatus.ALLOCATED for s in others.statuses)
    assert not pages & {loc.extents for loc in others.locations if loc is not None}
    more = core.allocate(ns_id, keys(1, start=200), [PAGE])
    assert more.statuses == [AllocStatus.NO_SPACE]  # quarantined pages are not reused
    clock.now += core.limits.ended_write_quarantine_s
    again = core.allocate(ns_id, keys(1, start=200), [PAGE])
    assert again.statuses == [AllocStatus.ALLOCATED]
    core.check_invariants()


def test_close_session_releases_and_counts(core: StoreCore) -> None:
    ns_id = core.register_namespace(NS, PAGE)
    held = committed(core, ns_id, 2)
    session = core.open_session()
    core.lookup(ns_id, held, lease_ttl_s=300, session=session)
    core.lookup(ns_id, held[:1], lease_ttl_s=300, session=session)
    released = core.lookup(ns_id, held, lease_ttl_s=300, session=session).lease_id
    core.release([released])  # ended by its holder: not the session's to end any more
    core.allocate(ns_id, keys(1), [PAGE], session=session)
    assert core.close_session(session) == 3
    assert core.close_session(session) == 0  # unknown now
    stats = core.stats()
    assert stats["pinned_bytes"] == 0 and stats["writing_bytes"] == 0
    assert stats["sessions_closed"] == 1 and stats["sessions_expired"] == 0
    core.check_invariants()


def test_unknown_session_changes_nothing(core: StoreCore) -> None:
    ns_id = core.register_namespace(NS, PAGE)
    held = committed(core, ns_id, 2)
    for call in (
        lambda: core.lookup(ns_id, held, lease_ttl_s=10, session=12345),
        lambda: core.allocate(ns_id, keys(2), [PAGE] * 2, session=12345),
    ):
        with pytest.raises(KvtierError) as err:
            call()
        assert err.value.code is ErrorCode.UNKNOWN_SESSION
    stats = core.stats()
    assert stats["read_leases"] == stats["write_leases"] == stats["pinned_bytes"] == 0
    assert stats["lookups"] == 0 and stats["allocated"] == 2  # only committed()'s
    assert core.lookup(ns_id, held, session=12345).lease_id == 0  # no lease: no session needed


def test_sessions_are_bounded(core: StoreCore) -> None:
    opened = [core.open_session() for _ in range(3)]
    with pytest.raises(KvtierError) as err:
        core.open_session()
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    core.close_session(opened[0])
    core.open_session()


def test_what_a_session_holds_is_bounded(clock: FakeClock) -> None:
    """Each lease is memory of the store's: a session holds at most so many, over at most so
    many chunks (a chunk under two leases counts twice). A refused call changes nothing; what
    ends (released, committed, expired, the session closed) is counted back."""
    limits = StoreLimits(
        session_timeout_s=5, max_leases_per_session=3, max_leased_chunks_per_session=5
    )
    core = StoreCore(
        node_id="n", epoch=1, capacity_bytes=16 * PAGE, page_size=PAGE, eviction="lru",
        lease_ttl_s=300, write_ttl_s=300, clock=clock, limits=limits,
    )  # fmt: skip
    ns_id = core.register_namespace(NS, PAGE)
    held = committed(core, ns_id, 3)
    session = core.open_session()
    first = core.lookup(ns_id, held[:2], 300, session=session).lease_id
    core.lookup(ns_id, held[:2], 300, session=session)  # the same chunks again: 4 of 5
    before = core.stats()
    for call, bound in (
        (lambda: core.lookup(ns_id, held[:2], 300, session=session), "chunks"),
        (lambda: core.allocate(ns_id, keys(2), [PAGE] * 2, session=session), "chunks"),
    ):
        with pytest.raises(KvtierError) as err:
            call()
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED and bound in err.value.message
    assert core.stats()["pinned_bytes"] == before["pinned_bytes"]
    assert core.stats()["used_bytes"] == before["used_bytes"]  # nothing allocated
    write = core.allocate(ns_id, keys(1), [PAGE], session=session).lease_id  # 5 of 5
    with pytest.raises(KvtierError) as err:  # 3 leases of 3
        core.lookup(ns_id, held[2:], 300, session=session)
    assert "store.max_leases_per_session" in err.value.message
    assert core.lookup(ns_id, held, 300).lease_id  # without a session: in-process callers
    core.release([first])
    core.commit(write, None, [1])  # the write lease ends with its last chunk
    assert core.lookup(ns_id, held[:2], 300, session=session).lease_id
    assert core.close_session(session) == 2
    other = core.open_session()
    assert core.lookup(ns_id, held[:2], 300, session=other).lease_id  # counted per session
    clock.now += 6  # no heartbeat: the session and its lease end, and are counted back
    core.reap()
    core.check_invariants()
    assert core.leases.held(other) == (0, 0)
