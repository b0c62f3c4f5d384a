"""Property tests (hypothesis) for the allocator and the store's eviction and lease invariants."""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.core.errors import KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.pool.allocator import PageAllocator
from kvtier.store.state.core import StoreCore
from kvtier.store.state.entries import ChunkState

PAGE = 4096
POOL_PAGES = 16


# -- allocator -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=80))
def test_allocator_never_overlaps_and_accounts_exactly(ops) -> None:
    alloc = PageAllocator(64)
    held: list[list[tuple[int, int]]] = []
    for is_alloc, pages, pick in ops:
        if is_alloc or not held:
            free_before = alloc.free_pages
            runs = alloc.allocate(pages)
            if pages > free_before:
                assert runs is None  # fails only when not enough pages are free in total
                continue
            assert runs is not None and sum(n for _, n in runs) == pages
            held.append(runs)
        else:
            alloc.free(held.pop(pick % len(held)))
        owned = sorted(r for runs in held for r in runs)
        for (s1, n1), (s2, _) in itertools.pairwise(owned):
            assert s1 + n1 <= s2, "two allocations share a page"
        free = alloc.free_runs()
        assert alloc.free_pages == sum(n for _, n in free)
        assert alloc.free_pages + sum(n for _, n in owned) == 64
        everything = sorted(owned + free)
        for (s1, n1), (s2, _) in itertools.pairwise(everything):
            assert s1 + n1 <= s2, "a free run overlaps an allocation"
        # free runs are always coalesced
        for (s1, n1), (s2, _) in itertools.pairwise(free):
            assert s1 + n1 < s2


def test_allocator_prefers_one_contiguous_run() -> None:
    alloc = PageAllocator(10)
    a = alloc.allocate(3)
    alloc.allocate(3)
    alloc.free(a)  # hole of 3 at the start, 4 free at the end
    assert alloc.allocate(4) == [(6, 4)]  # best fit: the run that fits, not the first hole
    assert alloc.allocate(3) == [(0, 3)]


def test_allocator_stitches_when_no_single_run_fits() -> None:
    alloc = PageAllocator(6)
    runs = [alloc.allocate(1) for _ in range(6)]
    alloc.free(runs[0])
    alloc.free(runs[2])
    alloc.free(runs[4])
    got = alloc.allocate(3)
    assert got is not None and sorted(got) == [(0, 1), (2, 1), (4, 1)]


# -- store -----------------------------------------------------------------------------------


NAMESPACES = [
    Namespace(model="a", dtype="f16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4),
    Namespace(model="b", dtype="f16", num_layers=3, num_kv_heads=1, head_size=8, chunk_tokens=4),
]
SIZES = [2 * PAGE + 100, 5 * PAGE]  # 3 and 5 pages: two chunk sizes share one pool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    read_leases = Bundle("read_leases")
    write_leases = Bundle("write_leases")

    @initialize(eviction=st.sampled_from(["lru", "s3fifo"]))
    def setup(self, eviction: str) -> None:
        self.clock = Clock()
        self.core = StoreCore(
            node_id="n",
            epoch=1,
            capacity_bytes=POOL_PAGES * PAGE,
            page_size=PAGE,
            eviction=eviction,
            lease_ttl_s=10,
            write_ttl_s=10,
            clock=self.clock,
        )
        self.ns_ids = [
            self.core.register_namespace(ns, s) for ns, s in zip(NAMESPACES, SIZES, strict=True)
        ]
        self.live_leases: dict[int, tuple[float, list[bytes]]] = {}  # read lease -> keys
        self.quarantined: list[tuple[float, list[tuple[int, int]]]] = []  # (until, page runs)

    def _keys(self, ns: int, start: int, n: int) -> list[bytes]:
        return prompt_keys(NAMESPACES[ns], list(range(4 * start, 4 * (start + n))))

    def _evictable_pages(self) -> int:
        stats = self.core.stats()
        return (stats["committed_bytes"] - stats["pinned_bytes"]) // PAGE

    @rule(
        target=write_leases,
        ns=st.integers(0, 1),
        start=st.integers(0, 4),
        n=st.integers(1, 4),
        commit=st.booleans(),
    )
    def put(self, ns: int, start: int, n: int, commit: bool):
        ks = self._keys(ns, start, n)
        pages_each = -(-SIZES[ns] // PAGE)
        self.core.reap()
        room = self.core.stats()["free_bytes"] // PAGE + self._evictable_pages()
        result = self.core.allocate(self.ns_ids[ns], ks, [SIZES[ns]] * n)
        for status in result.statuses:
            if status is AllocStatus.NO_SPACE:
                # a put fails only when freeing every evictable chunk would not make room
                assert room < pages_each
            elif status is AllocStatus.ALLOCATED:
                room -= pages_each
        if result.lease_id and commit:
            done = sum(s is AllocStatus.ALLOCATED for s in result.statuses)
            self.core.commit(result.lease_id, None, [7] * done)
            return 0
        return result.lease_id

    @rule(lease=consumes(write_leases))
    def finish_write(self, lease: int) -> None:
        if lease:
            with contextlib.suppress(KvtierError):  # expired or already finished
                self.core.abort(lease)

    @rule(lease=consumes(write_leases), quarantine=st.floats(0.5, 8))
    def abort_quarantined(self, lease: int, quarantine: float) -> None:
        """A failed remote transfer: its pages must not be handed out until the end."""
        held = self.core.leases.get(lease) if lease else None
        if held is None:
            return
        runs = [run for entry in held.entries for run in entry.runs]
        self.core.abort(lease, None, quarantine_s=quarantine)
        self.quarantined.append((self.clock.now + quarantine, runs))

    @rule(target=read_leases, ns=st.integers(0, 1), start=st.integers(0, 4), n=st.integers(1, 6))
    def read(self, ns: int, start: int, n: int):
        result = self.core.lookup(self.ns_ids[ns], self._keys(ns, start, n), lease_ttl_s=5)
        if result.lease_id:
            self.live_leases[result.lease_id] = (self.clock.now + 5, [h.key for h in result.hits])
        return result.lease_id

    @rule(ns=st.integers(0, 1), start=st.integers(0, 4), n=st.integers(1, 6))
    def touch(self, ns: int, start: int, n: int) -> None:
        self.core.lookup(self.ns_ids[ns], self._keys(ns, start, n))

    @rule(lease=consumes(read_leases))
    def release(self, lease: int) -> None:
        if not lease:
            return
        expected = self.live_leases.pop(lease, None)
        status = self.core.release([lease])[0]
        if expected is not None and self.clock.now < expected[0]:
            assert status is LeaseStatus.OK
        else:
            assert status in (LeaseStatus.EXPIRED, LeaseStatus.OK)

    @rule(ns=st.integers(0, 1), start=st.integers(0, 4), n=st.integers(1, 4))
    def delete(self, ns: int, start: int, n: int) -> None:
        ks = self._keys(ns, start, n)
        self.core.delete(self.ns_ids[ns], ks)
        for _, leased in self.live_leases.values():
            for k in ks:
                if k in leased:
                    leased.remove(k)

    @precondition(lambda self: self.clock.now < 100)
    @rule(dt=st.floats(0.1, 7))
    def advance(self, dt: float) -> None:
        self.clock.now += dt
        self.core.reap()
        self.live_leases = {k: v for k, v in self.live_leases.items() if v[0] > self.clock.now}

    @rule()
    def clear(self) -> None:
        self.core.clear()
        for _, leased in self.live_leases.values():
            leased.clear()

    @invariant()
    def accounting_adds_up(self) -> None:
        self.core.check_invariants()
        stats = self.core.stats()
        assert stats["used_bytes"] <= stats["capacity_bytes"]

    @invariant()
    def leased_chunks_stay_put(self) -> None:
        table = self.core.pages.table
        for _, leased in self.live_leases.values():
            for key in leased:
                entry = table.get(key)
                assert entry is not None and entry.state is ChunkState.COMMITTED
                assert entry.pins > 0

    @invariant()
    def quarantined_pages_stay_unused(self) -> None:
        self.quarantined = [(t, r) for t, r in self.quarantined if t > self.clock.now]
        held = {
            page
            for entry in self.core.pages.table.values()
            for start, n in entry.runs
            for page in range(start, start + n)
        }
        free = {
            p for start, n in self.core.pages.alloc.free_runs() for p in range(start, start + n)
        }
        for _, runs in self.quarantined:
            pages = {p for start, n in runs for p in range(start, start + n)}
            assert not pages & held, "a quarantined page was reused"
            assert not pages & free, "a quarantined page was freed early"

    @invariant()
    def no_two_chunks_share_a_page(self) -> None:
        pages = []
        for entry in self.core.pages.table.values():
            pages += [(s, n) for s, n in entry.runs]
        pages.sort()
        for (s1, n1), (s2, _) in itertools.pairwise(pages):
            assert s1 + n1 <= s2


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
