"""A failed load never becomes a wrong token later: vLLM's real ``Scheduler`` drives the
connector (``support/engine_rig.py``), a chunk's bytes are damaged in the pool between lookup
and load (the worker's checksum catches it: a real failure path), and what follows - an abort, a
recompute spread over several steps, a preemption - must not leave KV that was never loaded
where a later request reads it: in vLLM's prefix cache, or saved to the pool.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.connector.metadata import KvtierMetadata
from kvtier.store.client.shm import SharedSegment

from support.engine_rig import BLOCK, EngineRig

PROMPT = list(range(100, 260))  # 160 tokens: five 32-token chunks, ten blocks


def damage_last_chunk(meta: KvtierMetadata) -> None:
    """Overwrite the first bytes of each load's last chunk in the pool (after the lookup
    checksummed it): the worker's verification fails that chunk's load."""
    for job in meta.loads:
        segment = job.segments[0]
        pool = SharedSegment.attach(segment.name, segment.size)
        offset, _ = job.chunks[0][-1].extents[0]
        pool.write([(offset, 64)], b"\xff" * 64)
        pool.close()


def seed(rig: EngineRig, prompt: list[int] = PROMPT) -> None:
    """Compute ``prompt`` once (saved to the pool), then drop it from vLLM's own cache."""
    rig.add("seed", prompt)
    rig.run()
    rig.settle()
    assert rig.scheduler.kv_cache_manager.reset_prefix_cache()


def fail_load(rig: EngineRig, req_id: str, prompt: list[int]) -> None:
    rig.add(req_id, prompt)
    report = rig.step(damage_last_chunk)
    assert report.load_errors, "the damaged chunk's load must fail"


def test_abort_after_failed_load_leaves_no_device_hit(tmp_path: Path) -> None:
    rig = EngineRig(tmp_path)
    try:
        seed(rig)
        fail_load(rig, "r1", PROMPT + list(range(600, 640)))
        rig.abort("r1")  # before it recomputed anything
        rig.add("r3", PROMPT)
        rig.run()
        assert rig.wrong == []
        rig.connector.scheduler.take_stats()
        assert rig.counters.get("device_blocks_evicted", 0) >= 2
    finally:
        rig.close()


def test_recompute_over_several_steps_is_not_shared_early(tmp_path: Path) -> None:
    """r1's recompute takes five steps (32 tokens each); r3 arrives in the first."""
    rig = EngineRig(tmp_path, max_num_batched_tokens=48)
    try:
        seed(rig)
        fail_load(rig, "r1", PROMPT + list(range(600, 640)))
        rig.add("r3", PROMPT + list(range(700, 710)))
        rig.run()
        assert rig.wrong == []
        assert rig.outputs_of("r1") and rig.outputs_of("r3")
    finally:
        rig.close()


def _preempted_after_failed_load(rig: EngineRig) -> int:
    """r1's load fails in the step where ``long`` fills the last free block; ``long``'s next
    token needs a block: vLLM preempts the newest request, r1, before it recomputed."""
    rig.add("long", list(range(900, 917)), max_tokens=24)
    while rig.requests["long"].num_computed_tokens < 2 * BLOCK - 1:
        rig.step()
    free = rig.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    extra = free * BLOCK - len(PROMPT)
    assert extra > 0
    fail_load(rig, "r1", PROMPT + list(range(600, 600 + extra)))
    preempted = rig.step().preempted
    assert preempted == {"r1"}, "the drill needs r1 preempted before it recomputes"
    reports = rig.run()
    assert rig.outputs_of("r1") and rig.outputs_of("long")
    return next(r.starts["r1"] for r in reports if "r1" in r.starts)  # where r1 resumed


def test_preempted_after_failed_load_resumes_exact(tmp_path: Path) -> None:
    rig = EngineRig(tmp_path, num_blocks=15, max_num_seqs=2)
    try:
        seed(rig)
        _preempted_after_failed_load(rig)
        rig.settle()
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
        rig.add("r9", [*PROMPT, 5, 6, 7])  # loads whatever the pool holds now
        rig.run()
        assert rig.wrong == []
    finally:
        rig.close()


def test_unfilled_blocks_are_never_saved_even_if_vllm_still_caches_them(
    tmp_path: Path,
) -> None:
    """kvtier's own half, with the prefix-cache eviction switched off (as if vLLM kept the
    blocks cached for a request sharing them): r1 resumes on a device hit over blocks its
    load never filled; nothing it saves from them may reach the pool."""
    rig = EngineRig(tmp_path, num_blocks=15, max_num_seqs=2)
    rig.connector.scheduler.evict_device_blocks = None
    try:
        seed(rig)
        resumed_at = _preempted_after_failed_load(rig)
        assert resumed_at > 0, "r1 must resume on a device hit"
        rig.settle()
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
        rig.add("r9", [*PROMPT, 5, 6, 7])
        rig.run()
        assert [w.req_id for w in rig.wrong if w.req_id == "r9"] == []
    finally:
        rig.close()


def test_async_scheduling_makes_loads_async_and_their_failures_exact(tmp_path: Path) -> None:
    """With async scheduling (vLLM's default on CUDA) a sync load's failure is known only
    after the next step was scheduled over it: the connector loads asynchronously instead,
    and a failed async load is recomputed before its request computes anything."""
    rig = EngineRig(tmp_path, async_scheduling=True)
    try:
        assert rig.connector.config.load_mode == "async"
        seed(rig)
        rig.add("r1", [*PROMPT, *range(600, 640)])
        rig.step(damage_last_chunk)
        rig.add("r2", [*PROMPT, *range(700, 720)])  # same prefix while r1 recovers
        rig.run()
        assert rig.counters.get("load_failed_requests", 0) == 1
        assert rig.wrong == []
        assert rig.outputs_of("r1") and rig.outputs_of("r2")
    finally:
        rig.close()


def test_load_mode_follows_async_scheduling_and_kv_cache_groups() -> None:
    from kvtier.connector.config import with_engine_constraints
    from kvtier.core.config.connector import ConnectorConfig

    sync = ConnectorConfig(load_mode="sync")
    assert with_engine_constraints(sync, async_scheduling=True).load_mode == "async"
    assert with_engine_constraints(sync, async_scheduling=False).load_mode == "sync"
    assert with_engine_constraints(ConnectorConfig(load_mode="async"), True).load_mode == "async"
    # a hybrid model's load failures reach vLLM per request, for async loads only
    assert with_engine_constraints(sync, False, hybrid=True).load_mode == "async"


def test_a_sliding_window_engine_waits_for_a_steps_pool_space_unless_told_otherwise() -> None:
    """A sliding window passes blocks as a request decodes: a save sent a step late is
    dropped, so such an engine waits for the step's pool space; other engines never wait; a
    ``save_wait_s`` that is set wins."""
    from kvtier.connector.layout import FULL, SLIDING_WINDOW, GroupGeometry, KvGeometry
    from kvtier.connector.saves import WINDOW_SAVE_WAIT_S, save_wait
    from kvtier.core.config.connector import ConnectorConfig

    plain = KvGeometry(("l0",), 32, 1024, 64, "t")
    window = KvGeometry(
        ("l0", "l1"), 32, 1024, 64, "t",
        groups=(
            GroupGeometry(FULL, ("l0",), 2),
            GroupGeometry(SLIDING_WINDOW, ("l1",), 1, 32),
        ),
    )  # fmt: skip
    assert save_wait(ConnectorConfig(), plain) == 0.0
    assert save_wait(ConnectorConfig(), window) == WINDOW_SAVE_WAIT_S > 0
    assert save_wait(ConnectorConfig(save_wait_s=0.0), window) == 0.0
    assert save_wait(ConnectorConfig(save_wait_s=0.5), plain) == 0.5
