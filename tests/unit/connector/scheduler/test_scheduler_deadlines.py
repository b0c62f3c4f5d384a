"""A slow store costs vLLM's scheduler thread a small, bounded wait, never the store's delay.

The store here is served (the connector uses its lookup / alloc / ops threads, as with a
store in another process) and stalls the call under test until the test lets it go. A lookup
past ``lookup_deadline_s`` answers "no hit"; the lookups of one step share one
``lookup_wait_s``; past ``max_pending_lookups`` a request is a miss; a read lease too close to
its end fails the load before the copy; pool space later than ``save_wait_s`` is used in a
later step while vLLM holds the finished request's blocks.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import pytest

PROMPT = list(range(2000, 2160))  # 160 tokens: five chunks
TAIL = list(range(6000, 6033))


def test_a_lookup_past_its_deadline_is_a_miss_and_never_blocks(make_rig) -> None:
    rig = make_rig(served=True, lookup_wait_s=0.005, lookup_deadline_s=0.2)
    rig.seed(PROMPT)  # what the stalled lookup would find
    gate = rig.store.stall("lookup")
    request = rig.request("r", PROMPT + TAIL)
    answers: list[int | None] = []
    slowest = 0.0
    started = time.monotonic()
    while not answers or answers[-1] is None:  # vLLM asks again every step
        assert time.monotonic() - started < 5, "the lookup never gave up"
        asked = time.monotonic()
        answers.append(rig.sched.get_num_new_matched_tokens(request, 0)[0])
        slowest = max(slowest, time.monotonic() - asked)
        rig.step()
        time.sleep(0.01)
    assert answers[0] is None and answers[-1] == 0  # "ask again", then "no hit"
    assert time.monotonic() - started >= 0.2
    assert slowest < 0.1  # each ask waited its step's budget, never the stalled store
    counts = rig.counts()
    assert counts["lookup_deadline_misses"] == 1
    assert counts["lookups_pending"] == len(answers) - 1
    # asked again for the same local hit: the same answer, no lookup queued behind the first
    assert rig.sched.get_num_new_matched_tokens(request, 0) == (0, False)
    lookups, releases = rig.store.calls["lookup"], rig.store.calls["release"]
    gate.set()  # the store answers at last: the run it leased is given back at once
    rig.until(lambda: rig.store.calls["lookup"] == lookups + 1, what="the late lookup")
    rig.until(
        lambda: rig.store.calls["release"] > releases and rig.read_leases() == 0,
        what="the late lookup's lease released",
    )


@pytest.mark.parametrize(
    ("tokens", "local_hit", "min_hit"),
    [(20, 0, 32), (40, 32, 32), (90, 0, 96)],
    ids=["shorter-than-a-chunk", "past-vllms-own-hit", "below-min-hit-tokens"],
)
def test_a_request_nothing_could_hit_never_queues_behind_slow_lookups(
    make_rig, tokens: int, local_hit: int, min_hit: int
) -> None:
    """Both lookup threads stall on the store (slow pulls); a request with no whole chunk
    past vLLM's own hit (or less than ``min_hit_tokens`` to gain) answers "no hit" at once on
    the scheduler thread instead of waiting in their queue, up to ``lookup_deadline_s``.
    90 tokens can hit two chunks (64 tokens) at most, under a 96-token minimum."""
    rig = make_rig(
        served=True, lookup_wait_s=0.001, lookup_deadline_s=30, min_hit_tokens={"cpu": min_hit}
    )
    gate = rig.store.stall("lookup")
    slow = [rig.request(f"slow{i}", range(1000 * i, 1000 * i + 160)) for i in range(2)]
    assert [rig.sched.get_num_new_matched_tokens(r, 0)[0] for r in slow] == [None, None]
    rig.until(lambda: len(gate_waiters(rig)) == 2, what="both lookup threads stalled")
    request = rig.request("short", range(9000, 9000 + tokens))
    started = time.monotonic()
    assert rig.sched.get_num_new_matched_tokens(request, local_hit) == (0, False)
    assert time.monotonic() - started < 1.0
    assert rig.store.calls["lookup"] == 0
    gate.set()


def gate_waiters(rig) -> list[str]:
    """Names of the connector's lookup threads now inside the store's stalled lookup."""
    frames = sys._current_frames()
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("kvtier-lookup")
        and (frame := frames.get(t.ident or 0)) is not None
        and any(f.f_code.co_name == "_call" for f, _ in traceback.walk_stack(frame))
    ]


def test_one_wait_budget_per_step_and_a_bounded_queue(make_rig) -> None:
    rig = make_rig(served=True, lookup_wait_s=0.1, max_pending_lookups=4)
    gate = rig.store.stall("lookup")
    requests = [rig.request(f"r{i}", range(100 * i, 100 * i + 100)) for i in range(10)]
    started = time.monotonic()
    answers = [rig.sched.get_num_new_matched_tokens(r, 0)[0] for r in requests]
    waited = time.monotonic() - started
    assert answers == [None] * 4 + [0] * 6  # four in flight, the rest misses, not queued
    # one 100 ms budget for the step's lookups, not 100 ms each (400 ms for the four)
    assert waited < 0.3
    counts = rig.counts()
    assert counts["lookups_pending"] == 4
    assert counts["lookups_shed"] == 6
    gate.set()
    rig.step()
    for r in requests[:4]:
        assert rig.lookup(r) == 0  # answered now (nothing stored): a miss
    assert rig.lookup(requests[4]) == 0  # a slot is free: looked up this time
    assert rig.counts()["lookups"] == 5


def test_a_lease_about_to_lapse_fails_the_load_before_the_copy(make_rig) -> None:
    """The scheduler thread stalled between the lookup and the step's dispatch (a GC pause,
    a slow hook) until the lease had under a quarter of its TTL left: the chunks may be
    evicted and overwritten during the copy, so nothing is copied and vLLM recomputes."""
    rig = make_rig(load_lease_ttl_s=0.4)
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160
    time.sleep(0.32)
    blocks = rig.allocate(request)
    rig.sched.update_state_after_alloc(request, (blocks,), 160)
    step = rig.step([(request, 160, len(TAIL))])
    (job,) = step.meta.loads
    assert job.failed == "its lease lapsed (or was about to) before the copy"
    assert step.invalid_block_ids == set(blocks[:10])  # vLLM recomputes all of the hit
    assert not any(rig.page_of(b).any() for b in blocks[:10])  # nothing was copied
    assert rig.counts()["lease_lapsed_loads"] == 1
    assert rig.read_leases() == 0
    assert rig.lookup(request, 0) == 0  # the same bytes are not offered again
    rig.step([(request, 0, request.num_tokens)], finished=[request])  # the recompute
    assert rig.stored(PROMPT + TAIL) == 6  # ... saves what it computed, exactly


def test_a_late_allocation_is_sent_in_a_later_step_while_vllm_holds_the_blocks(
    make_rig,
) -> None:
    rig = make_rig(served=True, save_wait_s=0.005)
    gate = rig.store.stall("allocate")
    request = rig.request("r", PROMPT)
    assert rig.admit(request) == 0
    started = time.monotonic()
    step = rig.step([(request, 0, len(PROMPT))], finished=[request])
    assert time.monotonic() - started < 1  # the store stalls for 30 s unless let go
    assert step.meta.saves == []
    assert step.held == {"r": True}  # vLLM must keep the blocks: the copy is still to come
    gate.set()
    deadline = time.monotonic() + 5
    while not (step := rig.step()).meta.saves:
        assert time.monotonic() < deadline, "the late allocation was never used"
        time.sleep(0.005)
    assert step.meta.release_blocks == ["r"]  # copied in this step: the blocks may go
    assert step.finished_sending == {"r"}
    rig.until(lambda: rig.stored(PROMPT) == 5)
    assert rig.counts()["save_deferred"] >= 1
    rig.until(lambda: rig.write_leases() == 0, what="no write lease left")
