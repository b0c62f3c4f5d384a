"""A slow store costs the scheduler thread one small wait per step, whatever the queue.

vLLM's real ``Scheduler`` asks the connector about every waiting request each step; with a
store whose lookups take 200 ms (injected: a loaded or remote store) and 40 requests
waiting, the waits of one step share one ``lookup_wait_s`` budget, and past
``max_pending_lookups`` in flight a request is a miss instead of one more lookup queued.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support.engine_rig import EngineRig


def _slow_store(rig: EngineRig, seconds: float) -> None:
    scheduler = rig.connector.scheduler
    scheduler.lookups.executor = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup")
    resolve = scheduler.resolver.resolve

    def slow(state, computed):
        time.sleep(seconds)
        return resolve(state, computed)

    scheduler.resolver.resolve = slow


def test_one_wait_budget_per_step_and_a_bounded_queue(tmp_path: Path) -> None:
    wait_s, steps = 0.02, 4
    rig = EngineRig(
        tmp_path,
        max_num_seqs=64,
        extra={"lookup_wait_s": wait_s, "max_pending_lookups": 8},
    )
    try:
        _slow_store(rig, 0.2)
        for i in range(40):
            rig.add(f"r{i}", list(range(4 + i, 4 + i + 100)))
        for _ in range(steps):
            rig.step()
        rig.connector.scheduler.take_stats()
        waited = rig.counters.get("lookup_wait_seconds", 0)
        # one budget per step (a few ms of slack for the last wait's wake-up), where each
        # request waiting its own budget would be 40 x 20 ms per step
        assert waited <= steps * wait_s + 0.05
        assert rig.counters.get("lookups_shed", 0) >= 40 - 8
        rig.run()
        assert all(rig.outputs_of(f"r{i}") for i in range(40))
        assert rig.wrong == []
    finally:
        rig.connector.scheduler.lookups.shutdown()
        rig.close()


def test_a_slow_lookup_is_waited_for_in_one_step_only(tmp_path: Path) -> None:
    """A lookup slower than the budget (a remote tier's index query on a loaded machine)
    blocks the scheduler in the step that started it; the steps after only look whether it
    is done, so it cannot take ``lookup_wait_s`` from every step of the decodes beside it."""
    wait_s, steps = 0.02, 6
    rig = EngineRig(tmp_path, extra={"lookup_wait_s": wait_s})
    try:
        rig.add("decoding", list(range(500, 540)), max_tokens=40)
        for _ in range(3):
            rig.step()
        rig.connector.scheduler.take_stats()
        before = rig.counters.get("lookup_wait_seconds", 0)
        _slow_store(rig, 0.3)
        rig.add("slow", list(range(4, 104)))
        for _ in range(steps):
            rig.step()
        rig.connector.scheduler.take_stats()
        waited = rig.counters.get("lookup_wait_seconds", 0) - before
        assert wait_s * 0.5 <= waited <= wait_s + 0.01  # one step's wait, not six
        assert rig.counters.get("lookups_pending", 0) >= steps - 1
        rig.run()
        assert rig.outputs_of("slow") and len(rig.outputs_of("decoding")) == 40
        assert rig.wrong == []
    finally:
        rig.connector.scheduler.lookups.shutdown()
        rig.close()


def test_an_idle_engine_waits_each_step_but_not_on_its_hook_clock(tmp_path: Path) -> None:
    """With nothing else to run, a step waits for the pending lookup again (the engine's loop
    would only spin), and that wait held no decode up: the connector's hook time (what
    ``vllm:kvtier_scheduler_hook_seconds`` reports per step) leaves it out."""
    wait_s, steps = 0.02, 5
    rig = EngineRig(tmp_path, extra={"lookup_wait_s": wait_s})
    try:
        _slow_store(rig, 0.5)
        rig.add("alone", list(range(4, 104)))
        hook_s = 0.0
        take_stats = rig.connector.get_kv_connector_stats

        def hook_clock():  # what vLLM reads each step: the hook seconds ride along
            nonlocal hook_s
            stats = take_stats()
            hook_s += stats.data.get("scheduler_hook_seconds", 0.0) if stats else 0.0
            return stats

        rig.connector.get_kv_connector_stats = hook_clock
        for _ in range(steps):
            rig.step()
        hook_clock()
        waited = rig.counters.get("lookup_wait_seconds", 0)
        assert waited >= (steps - 1) * wait_s  # every step waited
        assert hook_s < waited / 2  # and none of it counts as the engine's cost
        rig.run()
        assert rig.outputs_of("alone") and rig.wrong == []
    finally:
        rig.connector.scheduler.lookups.shutdown()
        rig.close()
