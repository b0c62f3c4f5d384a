"""Namespaces are retired once empty and idle, so a long-lived store never fills up with them.

Namespaces multiply in production (tenant salts x TP ranks x LoRA adapters x cache-reset
generations); before retirement a store past ``store.max_namespaces`` refused every new one
and silently stopped caching until restarted. Now a namespace with no chunk left (none
stored, being written or pinned) and unused for ``namespace_idle_s`` is retired: by the
periodic reap, and least recently used first by a registration that would exceed the bound.
A namespace with chunks never is; a retired id answers UNKNOWN_NAMESPACE, as after a restart,
and is registered again by its client.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import pytest

from kvtier.core.chunks import LookupStatus
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys, salt_digest
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.node import NodeStore
from kvtier.store.server.metrics import StoreCollector
from kvtier.store.state.core import StoreCore
from kvtier.store.state.limits import StoreLimits
from kvtier.tiers.cpu import CpuTier

PAGE = 4096
IDLE = 60.0  # namespace_idle_s of the cores below


class FakeClock:
    """Time under test control: idleness without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: FakeClock, max_namespaces: int, idle_s: float = IDLE) -> StoreCore:
    return StoreCore(
        node_id="n",
        epoch=1,
        capacity_bytes=64 * PAGE,
        page_size=PAGE,
        eviction="lru",
        lease_ttl_s=300,
        write_ttl_s=300,
        clock=clock,
        limits=StoreLimits(max_namespaces=max_namespaces, namespace_idle_s=idle_s),
    )


def ns(i: int, salt: str = "") -> Namespace:
    return Namespace(
        model=f"m{i}", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4,
        cache_salt=salt,
    )  # fmt: skip


def keys(namespace: Namespace, n: int = 1) -> list[bytes]:
    return prompt_keys(namespace, list(range(4 * n)))


def put(core: StoreCore, ns_id: bytes, ks: list[bytes]) -> None:
    result = core.allocate(ns_id, ks, [PAGE] * len(ks))
    assert result.statuses == [AllocStatus.ALLOCATED] * len(ks)
    assert core.commit(result.lease_id, None, [1] * len(ks)) == len(ks)


def known(core: StoreCore, ns_id: bytes) -> bool:
    try:
        core.namespace(ns_id)
    except KvtierError as exc:
        assert exc.code is ErrorCode.UNKNOWN_NAMESPACE
        return False
    return True


def fill(core: StoreCore, clock: FakeClock, n: int) -> list[bytes]:
    """Register ``n`` empty namespaces one second apart (their least-recently-used order)."""
    ids = []
    for i in range(n):
        ids.append(core.register_namespace(ns(i), PAGE))
        clock.now += 1
    return ids


# -- (1) a full store registers a new namespace by retiring idle empty ones -----------------


def test_full_store_of_idle_empty_namespaces_registers_a_new_one() -> None:
    clock = FakeClock()
    core = make_core(clock, max_namespaces=8)
    ids = fill(core, clock, 8)
    # Not idle long enough yet: refused, as before retirement.
    with pytest.raises(KvtierError) as err:
        core.register_namespace(ns(100), PAGE)
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    assert "store.max_namespaces = 8" in err.value.message
    clock.now += IDLE
    core.lookup(ids[0], keys(ns(0)))  # a use: ids[0] is now the most recently used
    new = core.register_namespace(ns(100), PAGE)
    # Exactly one retired, the least recently used: ids[1] (ids[0] was just looked up).
    assert [known(core, i) for i in ids] == [True, False] + [True] * 6
    assert known(core, new) and core.stats()["namespaces"] == 8
    assert core.stats()["namespaces_retired"] == 1
    core.register_namespace(ns(101), PAGE)
    assert not known(core, ids[2]) and core.stats()["namespaces_retired"] == 2
    # Re-registering a known namespace is a use too, and never retires anything.
    assert core.register_namespace(ns(3), PAGE) == ids[3]
    core.register_namespace(ns(102), PAGE)
    assert known(core, ids[3]) and not known(core, ids[4])
    core.check_invariants()


def test_without_retirement_a_full_store_refuses() -> None:
    """The same store with an infinite idle period behaves as before: full is full."""
    clock = FakeClock()
    core = make_core(clock, max_namespaces=8, idle_s=math.inf)
    ids = fill(core, clock, 8)
    clock.now += 1e9
    core.reap()
    with pytest.raises(KvtierError) as err:
        core.register_namespace(ns(100), PAGE)
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    assert all(known(core, i) for i in ids)
    assert core.stats()["namespaces_retired"] == 0


# -- (2) a namespace that holds anything is never retired -----------------------------------


def test_namespaces_holding_chunks_or_leases_are_never_retired() -> None:
    clock = FakeClock()
    core = make_core(clock, max_namespaces=5)
    committed, writing, read, doomed_writing, empty = fill(core, clock, 5)
    put(core, committed, keys(ns(0)))
    write_lease = core.allocate(writing, keys(ns(1)), [PAGE]).lease_id
    # Read lease on a chunk deleted since: out of the table, only the lease pins it.
    put(core, read, keys(ns(2)))
    read_lease = core.lookup(read, keys(ns(2)), lease_ttl_s=300).lease_id
    assert core.delete(read, keys(ns(2))) == 1
    # Write lease on a chunk deleted while being written: still the lease's until it ends.
    doomed_lease = core.allocate(doomed_writing, keys(ns(3)), [PAGE]).lease_id
    core.delete(doomed_writing, keys(ns(3)))
    clock.now += IDLE + 10  # every lease above still runs (TTL 300)
    core.reap()
    assert not known(core, empty)
    holding = [committed, writing, read, doomed_writing]
    assert all(known(core, i) for i in holding)
    core.check_invariants()
    # Full of namespaces with something in them: a new one is refused (nothing to retire).
    core.register_namespace(ns(100), PAGE)
    with pytest.raises(KvtierError) as err:
        core.register_namespace(ns(101), PAGE)
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    assert all(known(core, i) for i in holding)
    # Once they hold nothing and stay unused, they go too.
    assert core.commit(write_lease, None, [1]) == 1
    assert core.delete(writing, keys(ns(1))) == 1
    assert core.release([read_lease]) == [LeaseStatus.OK]
    assert core.abort(doomed_lease) == 1
    clock.now += IDLE
    core.reap()
    assert [known(core, i) for i in holding] == [True, False, False, False]
    assert core.lookup(committed, keys(ns(0))).stop is LookupStatus.HIT
    core.check_invariants()


def test_expired_write_lease_no_longer_holds_its_namespace() -> None:
    clock = FakeClock()
    core = make_core(clock, max_namespaces=1)
    (writing,) = fill(core, clock, 1)
    core.allocate(writing, keys(ns(0)), [PAGE], ttl_s=10)
    clock.now += IDLE
    # The registration reaps the expired lease first, then retires the now empty namespace.
    core.register_namespace(ns(100), PAGE)
    assert not known(core, writing)
    # its pages are quarantined (a late copy may still land), then free
    assert core.stats()["used_bytes"] == core.stats()["quarantined_bytes"] > 0
    clock.now += core.limits.ended_write_quarantine_s + 1
    core.reap()
    assert core.stats()["used_bytes"] == 0
    core.check_invariants()


# -- (3) a retired id answers UNKNOWN_NAMESPACE and can be registered again -----------------


def test_retired_namespace_answers_unknown_and_registers_again() -> None:
    clock = FakeClock()
    core = make_core(clock, max_namespaces=4)
    salted = ns(0, salt_digest("tenant-salt"))
    ns_id = core.register_namespace(salted, PAGE)
    tenants = len(core.tenants.all())
    clock.now += IDLE
    core.reap()
    assert core.stats()["namespaces"] == 0
    # Its tenant (an unlisted salt) went with its last namespace.
    assert len(core.tenants.all()) == tenants - 1
    ks = keys(salted)
    for call in (
        lambda: core.lookup(ns_id, ks),
        lambda: core.lookup(ns_id, ks, lease_ttl_s=10),
        lambda: core.allocate(ns_id, ks, [PAGE]),
        lambda: core.committed_mask(ns_id, ks),
        lambda: core.delete(ns_id, ks),
    ):
        with pytest.raises(KvtierError) as err:
            call()
        assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
    assert core.register_namespace(salted, PAGE) == ns_id
    put(core, ns_id, ks)
    assert core.lookup(ns_id, ks).stop is LookupStatus.HIT
    assert core.stats()["tenant_used_bytes.other"] == PAGE
    core.check_invariants()


# -- (4) the periodic reap retires idle empty namespaces ------------------------------------


def test_reap_retires_idle_empty_namespaces_only() -> None:
    clock = FakeClock()
    core = make_core(clock, max_namespaces=100)
    ids = fill(core, clock, 6)
    clock.now += IDLE - 10  # ids[0..5] unused for 50..55 s
    core.reap()
    assert core.stats()["namespaces"] == 6  # none idle long enough yet
    # Uses that keep a namespace: lookup, allocate, committed_mask, delete.
    core.lookup(ids[0], keys(ns(0)))
    core.abort(core.allocate(ids[1], keys(ns(1)), [PAGE]).lease_id)
    core.committed_mask(ids[2], keys(ns(2)))
    core.delete(ids[3], keys(ns(3)))
    clock.now += 10  # ids[4], ids[5] unused for 60+ s; the others for 10 s
    core.reap()
    assert [known(core, i) for i in ids] == [True] * 4 + [False] * 2
    assert core.stats()["namespaces_retired"] == 2
    clock.now += IDLE
    core.reap()
    assert core.stats()["namespaces"] == 0 and core.stats()["namespaces_retired"] == 6
    core.check_invariants()


# -- the served store: its reaper, its metric, and a client that registers again -----------


@pytest.fixture
def node(store_config: StoreConfig) -> Iterator[NodeStore]:
    store = NodeStore(store_config, instance="ns-test")
    # Retire as soon as empty: the reaper thread does it within one period.
    store.core.namespaces.limits = dataclasses.replace(store.core.limits, namespace_idle_s=0.0)
    try:
        yield store
    finally:
        store.close()


def test_served_store_reaper_retires_and_client_registers_again(
    node: NodeStore, namespace: Namespace
) -> None:
    tier = CpuTier(node, segment=node.local_segment())
    chunk = 64 << 10
    ns_id = tier.namespace_id(namespace, chunk)
    deadline = time.monotonic() + 30
    while node.stats()["namespaces"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.stats()["namespaces"] == 0  # the reaper retired it: empty and idle
    families = {f.name: f for f in StoreCollector(node.stats).collect()}
    assert families["kvtier_store_namespaces_retired"].samples[0].value >= 1
    # The tier still has the id: the store answers as for any unknown namespace...
    ks = prompt_keys(namespace, list(range(32)))
    with pytest.raises(KvtierError) as err:
        tier.lookup(ns_id, ks)
    assert err.value.code is ErrorCode.UNKNOWN_NAMESPACE
    # ... and the connector's handling (lookup.py) forgets it, so the next use registers.
    tier.forget_namespace(ns_id)
    assert tier.namespace_id(namespace, chunk) == ns_id
    assert node.stats()["namespaces_retired"] >= 1
    node.core.check_invariants()
