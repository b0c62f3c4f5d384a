"""A worker unmaps the pool segment of a store that is gone (issue 18, item 10).

Drills with real shared-memory segments, named and created as a node store names and creates
its own (``kvtier-<node>-<epoch hex>``, reserved and prefaulted), and a real
``ConnectorWorker`` over CPU KV tensors in vLLM's layout (``support/kv_rig.py``), driven through
engine steps in vLLM's order. A store "restarts": its process drops its mapping and unlinks
its segment, the next incarnation creates a new one. Before the fix every worker kept the dead
segment mapped until MAX_MAPPED_SEGMENTS newer ones pushed it out, so its memory stayed
allocated: the node held two pools, or the restarted store could not reserve its own.

What is checked: /proc/self/maps (this process's mappings) and ``Shmem`` in /proc/meminfo
(the node's shared memory, what a new pool must fit beside); and that a segment a job of the
step is still copying through is not unmapped under it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Iterator, Sequence

import pytest

from kvtier.bench.micro import kv_layouts
from kvtier.connector.metadata import KvtierMetadata, SegmentRef
from kvtier.store.client.shm import SharedSegment, remove_segment

from support.kv_rig import KvRig

MiB = 1 << 20
GiB = 1 << 30
_serial = itertools.count()
CASE = kv_layouts.case_named("flash-attn")  # LBNHC, vLLM's CUDA default; 3 layers here


class Store:
    """A node store's pool segment over restarts, as ``store/node.py`` makes it."""

    def __init__(self) -> None:
        self.node = f"tmap{os.getpid()}x{next(_serial)}"
        self.epoch = 0
        self.segment: SharedSegment | None = None
        self.names: list[str] = []

    def next_ref(self, size: int) -> SegmentRef:
        epoch = self.epoch + 1
        return SegmentRef(f"kvtier-{self.node}-{epoch:016x}", size, epoch)

    def start(self, size: int) -> SegmentRef:
        """A new incarnation: its segment reserved (posix_fallocate) and populated."""
        ref = self.next_ref(size)
        self.names.append(ref.name)
        self.segment = SharedSegment.create(ref.name, size, prefault=True)
        self.epoch = ref.epoch
        return ref

    def stop(self) -> None:
        """The store exits: its own mapping goes and its segment is unlinked."""
        assert self.segment is not None
        self.segment.close()
        self.segment.unlink()
        self.segment = None

    def cleanup(self) -> None:
        if self.segment is not None:
            self.segment.close()
        for name in self.names:
            remove_segment(name)


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store()
    yield s
    s.cleanup()


@pytest.fixture
def rig() -> Iterator[KvRig]:
    r = KvRig(CASE, "cpu", num_blocks=48, pool_bytes=MiB)
    own = r.segment  # the rig's own pool is not used here: the Store's incarnations are
    own.close()
    own.unlink()
    yield r
    r.worker.shutdown()


def use(rig: KvRig, store: Store, ref: SegmentRef) -> None:
    """Point the rig's jobs at the store's current incarnation."""
    assert store.segment is not None and store.segment.name == ref.name
    rig.segment, rig.ref = store.segment, ref


def mapped(name: str) -> bool:
    """Does this process map ``/dev/shm/<name>`` (deleted or not)?"""
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{name}" in line for line in maps)


def worker_maps(rig: KvRig, name: str) -> bool:
    worker = rig.worker
    return name in worker._pools or any(p.segment.name == name for p in worker._retiring)


def shmem() -> int:
    """The node's shared memory in use, bytes (``Shmem`` of /proc/meminfo)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def round_trip(rig: KvRig, source: Sequence[int], target: Sequence[int]) -> None:
    """Save ``source``'s pages into the current pool, then load them (verified) into
    ``target``: every byte of the KV allocation as vLLM's placement rule says."""
    per = rig.geometry.blocks_per_chunk
    before = rig.snapshot()
    saved = rig.chunks(list(source))
    result = rig.step(saves=[rig.save_job(saved)])
    assert result.out.saved and not result.out.save_failed
    loads = [
        dataclasses.replace(c, block_ids=tuple(target[i * per : (i + 1) * per]))
        for i, c in enumerate(rig.with_checksums(saved))
    ]
    result = rig.step(loads=[rig.load_job(loads, is_async=False)])
    assert not result.load_errors and result.out.loaded == {"req-load": {0}}
    expected = rig.expect_loaded(before, before, list(zip(source, target, strict=True)))
    assert rig.snapshot().tobytes() == expected.tobytes()


# -- a restart: the dead segment is unmapped ---------------------------------------------------


def test_a_dead_segment_is_unmapped_at_the_next_step(rig: KvRig, store: Store) -> None:
    old = store.start(4 * MiB)
    use(rig, store, old)
    round_trip(rig, range(0, 4), range(4, 8))
    assert mapped(old.name) and worker_maps(rig, old.name)

    store.stop()  # the store restarts: only the worker maps the old segment now
    assert mapped(old.name), "the worker's mapping of the old pool outlives its store"
    rig.worker._next_retire = float("inf")  # a step inside RETIRE_PERIOD_S does not look
    rig.step()
    assert mapped(old.name)
    rig.worker._next_retire = 0.0  # the period is over: the next step's start looks
    rig.step()
    assert not mapped(old.name) and not worker_maps(rig, old.name)

    new = store.start(4 * MiB)
    use(rig, store, new)
    round_trip(rig, range(8, 12), range(12, 16))
    assert not mapped(old.name) and list(rig.worker._pools) == [new.name]


def test_a_dead_segment_is_unmapped_when_the_new_one_is_mapped(rig: KvRig, store: Store) -> None:
    """The restart lands inside a step (after its start looked): mapping the new
    incarnation for this step's save unmaps the old one there and then."""
    old = store.start(4 * MiB)
    use(rig, store, old)
    round_trip(rig, range(0, 4), range(4, 8))

    new_ref = store.next_ref(4 * MiB)
    rig.ref = new_ref
    meta = KvtierMetadata(saves=[rig.save_job(rig.chunks(list(range(8, 12))))])
    worker, first = rig.worker, rig.geometry.layer_names[0]
    worker.start_load_kv(meta)
    store.stop()
    use(rig, store, store.start(4 * MiB))
    assert mapped(old.name)
    worker.wait_for_layer_load(first)
    worker.save_layer(meta, first)  # maps the new segment
    assert not mapped(old.name) and not worker_maps(rig, old.name)
    for name in rig.geometry.layer_names[1:]:
        worker.wait_for_layer_load(name)
        worker.save_layer(meta, name)
    worker.save(meta)
    out = worker.take_worker_meta()
    assert out is not None and out.saved and not out.save_failed
    round_trip(rig, range(16, 20), range(20, 24))


# -- a pool sized to the node's shared memory --------------------------------------------------


def _pool_size(share: float) -> int:
    st = os.statvfs("/dev/shm")
    if st.f_blocks * st.f_frsize < 256 * MiB:
        pytest.skip(f"/dev/shm holds {st.f_blocks * st.f_frsize >> 20} MiB, under 256 MiB")
    free = st.f_bavail * st.f_frsize
    return min(int(free * share), 2 * GiB) // MiB * MiB


@pytest.mark.parametrize("restart", ["step-between", "new-pool-first"])
def test_a_restarted_store_gets_the_memory_back(
    rig: KvRig, store: Store, restart: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pool of ~60 % of the free /dev/shm (at most 2 GiB). ``step-between``: the engine
    steps between the old store's exit and the new one's start, which then reserves a pool
    the same size: it fits only because the worker let the old one go (with /dev/shm under
    3.3 GiB free the create fails without the fix; above it the node holds both).
    ``new-pool-first``: the new store reserves its pool before the worker's next step (sized
    so both fit, 45 % at most); the node holds both until that step maps the new one."""
    size = _pool_size(0.6 if restart == "step-between" else 0.45)
    base = shmem()
    old = store.start(size)
    use(rig, store, old)
    round_trip(rig, range(0, 4), range(4, 8))  # the worker maps it (populated)
    with_old = shmem()
    store.stop()
    orphaned = shmem()
    assert orphaned - base > 0.8 * size, "the worker's mapping keeps the old pool's memory"

    if restart == "step-between":
        rig.worker._next_retire = 0.0  # a step at least RETIRE_PERIOD_S after the last look
        rig.step()
        released = shmem()
        new = store.start(size)
        use(rig, store, new)
        peak = shmem()
    else:
        new = store.start(size)
        use(rig, store, new)
        peak = shmem()
        assert peak - base > 1.8 * size  # both pools: the old one still mapped
        rig.step(saves=[rig.save_job(rig.chunks(list(range(8, 12))))])  # the next job
        released = shmem() - size  # what is left besides the new pool
    round_trip(rig, range(12, 16), range(16, 20))
    after = shmem()
    with capsys.disabled():
        print(
            f"\n[{restart}] pool {size >> 20} MiB; Shmem MiB: before {base >> 20}, old pool "
            f"mapped {with_old >> 20}, old store gone {orphaned >> 20}, new pool "
            f"{peak >> 20} (old released: {released >> 20}), after a round trip {after >> 20}"
        )
    assert not mapped(old.name) and not worker_maps(rig, old.name)
    assert released - base < 0.2 * size, "the old pool's memory is released"
    assert after - base < 1.2 * size  # one pool, not two
    if restart == "step-between":
        assert peak - base < 1.2 * size  # the new store reserved its pool beside nothing


# -- never under a copy ------------------------------------------------------------------------


def test_a_segment_a_load_is_copying_through_is_not_unmapped_under_it(
    rig: KvRig, store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync load copies layer by layer on the load thread from the old incarnation; the
    store restarts while layer 1 is being copied, and the step's save maps the new
    incarnation. The old mapping must stay until the load is done with it: layer 1's copy
    completes through it, then the load fails for its reason (the store is gone, found by
    the next layer's check), not on a torn-down mapping; the next step unmaps it."""
    geo, worker = rig.geometry, rig.worker
    per = geo.blocks_per_chunk
    old = store.start(4 * MiB)
    use(rig, store, old)
    source, target = list(range(0, 8)), list(range(8, 16))
    saved = rig.chunks(source)
    assert rig.step(saves=[rig.save_job(saved)]).out.saved
    before = rig.snapshot()
    loads = [
        dataclasses.replace(c, block_ids=tuple(target[i * per : (i + 1) * per]))
        for i, c in enumerate(rig.with_checksums(saved))
    ]
    load = rig.load_job(loads, is_async=False)
    rig.ref = store.next_ref(4 * MiB)
    save = rig.save_job(rig.chunks(list(range(16, 20))))
    meta = KvtierMetadata(loads=[load], saves=[save])

    assert worker.kv is not None
    copy_layer, copied = worker.kv.load_layer, []
    entered, gate = threading.Event(), threading.Event()

    def gated(layer, pool, plan) -> None:  # layer 1's copy waits for the restart
        if layer == 1:
            entered.set()
            assert gate.wait(30)
        copy_layer(layer, pool, plan)
        copied.append(layer)

    monkeypatch.setattr(worker.kv, "load_layer", gated)
    names = geo.layer_names
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.connector.worker"):
            worker.start_load_kv(meta)
            worker.wait_for_layer_load(names[0])
            assert entered.wait(30)  # the load thread is copying layer 1
            old_pool = worker._pools[old.name]
            store.stop()  # the store restarts mid-step
            use(rig, store, store.start(4 * MiB))
            worker.save_layer(meta, names[0])  # maps the new segment: the old one is held
            assert mapped(old.name), "unmapped while the load thread copies through it"
            assert old_pool.tensor.numel() == old.size and old_pool.segment.array.size
            gate.set()
            for name in names[1:]:
                worker.wait_for_layer_load(name)
                worker.save_layer(meta, name)
            worker.save(meta)
    finally:
        gate.set()
    errors = worker.get_block_ids_with_load_errors()
    out = worker.take_worker_meta()
    assert out is not None and out.saved == {save.job_id: {0}}
    assert copied == [0, 1]  # layer 1 went on through the intact mapping, then it stopped
    after = rig.snapshot()
    for layer in range(geo.num_layers):
        for src, dst in zip(source, target, strict=True):
            want = rig.page(before, layer, src if layer < 2 else dst)
            assert rig.page(after, layer, dst) == want, (layer, dst)
    # ... and failed for the right reason: its extents' store is gone
    assert errors == set(target) and out.load_failed == {"req-load": {0}}
    reasons = [r.getMessage() for r in caplog.records if "kvtier load for" in r.getMessage()]
    assert len(reasons) == 1 and "is no longer the store's" in reasons[0], reasons
    assert mapped(old.name)  # held through the step's end

    rig.step()
    assert not mapped(old.name) and not worker_maps(rig, old.name)
    round_trip(rig, range(20, 24), range(24, 28))
