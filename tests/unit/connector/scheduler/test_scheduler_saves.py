"""A save that cannot get pool space is given up cleanly: no write lease or page left behind,
vLLM's blocks not held past the give-up, the scheduler never waiting for the store, and the
counters saying why. Pool space can be missing (every page pinned: NO_SPACE), refused (a batch
that would flush the pool: LIMIT_EXCEEDED), late (past ``save_defer_s``), or moot (vLLM
preempted the request while its allocation was on its way)."""

from __future__ import annotations

import time

PAGE = 4096  # one chunk per pool page (conftest's geometry)
PROMPT = list(range(11000, 11160))  # 160 tokens: five chunks


def prompt(start: int, chunks: int) -> list[int]:
    return list(range(start, start + chunks * 32))


def test_no_space_gives_the_save_up_cleanly(make_rig) -> None:
    rig = make_rig(capacity=16 * PAGE)
    full = prompt(20000, 16)
    rig.seed(full)  # the pool holds 16 chunks: it is full
    waiting = rig.request("w", [*full, 1])
    assert rig.lookup(waiting) == 16 * 32  # a request waiting to load pins all of them
    request = rig.request("r", [*prompt(30000, 2), 1])
    assert rig.admit(request) == 0
    step = rig.step([(request, 0, request.num_tokens)], finished=[request])
    assert step.meta.saves == []
    assert step.held == {"r": False}  # nothing to wait for: vLLM frees the blocks now
    assert rig.counts()["save_no_space"] == 2
    assert rig.write_leases() == 0 and rig.writing_bytes() == 0
    assert rig.held(prompt(30000, 2)) == []
    assert rig.held(full) == list(range(16))  # pinned chunks were not evicted
    # once the pins go, saves go through again: nothing was left stuck in the connector
    rig.finish(waiting)
    later = rig.request("r2", [*prompt(40000, 2), 1])
    rig.admit(later)
    rig.step([(later, 0, later.num_tokens)], finished=[later])
    assert rig.held(prompt(40000, 2)) == [0, 1]


def test_a_batch_the_store_refuses_is_a_save_error_and_evicts_nothing(make_rig) -> None:
    """A save of more than ``max_batch_fraction`` (a quarter) of a full pool is refused whole
    rather than flush other requests' chunks."""
    rig = make_rig(capacity=16 * PAGE)
    seeds = [prompt(50000 + 1000 * i, 4) for i in range(4)]
    for tokens in seeds:
        rig.seed(tokens)
    request = rig.request("r", [*prompt(60000, 5), 1])
    rig.admit(request)
    step = rig.step([(request, 0, request.num_tokens)], finished=[request])
    assert step.meta.saves == []
    assert step.held == {"r": False}
    assert rig.counts()["save_errors"] == 1
    assert rig.write_leases() == 0 and rig.writing_bytes() == 0
    assert all(rig.held(tokens) == [0, 1, 2, 3] for tokens in seeds)
    assert rig.held(prompt(60000, 5)) == []


def test_an_allocation_later_than_save_defer_s_is_given_up_and_its_pages_freed(
    make_rig,
) -> None:
    # space asked for, not held ahead (the test counts the store's calls)
    rig = make_rig(served=True, save_wait_s=0.005, save_defer_s=0.3, save_held_chunks=0)
    gate = rig.store.stall("allocate")
    request = rig.request("r", PROMPT)
    assert rig.admit(request) == 0
    started = time.monotonic()
    step = rig.step([(request, 0, len(PROMPT))], finished=[request])
    assert step.held == {"r": True}  # vLLM holds its blocks while the save may still come
    steps = []
    while not (step := rig.step()).meta.release_blocks:
        steps.append(step)
        assert time.monotonic() - started < 5, "the save was never given up"
        time.sleep(0.02)
    assert time.monotonic() - started >= 0.3
    assert all(s.meta.saves == [] for s in [*steps, step])
    assert step.finished_sending == {"r"}  # vLLM frees the blocks: nothing will copy them
    counts = rig.counts()
    assert counts["save_alloc_timeouts"] == 5
    assert counts["save_deferred"] >= 1
    gate.set()  # the store answers at last: the pages it granted go straight back
    rig.until(
        lambda: rig.store.calls["allocate"] == 1 and rig.store.calls["abort"] == 1,
        what="the late allocation aborted",
    )
    rig.until(lambda: rig.write_leases() == 0 and rig.writing_bytes() == 0)
    assert rig.held(PROMPT) == []
    assert all(rig.step().meta.saves == [] for _ in range(3))


def test_a_preempted_request_drops_the_save_waiting_for_pool_space(make_rig) -> None:
    """vLLM freed a preempted request's blocks: a save still waiting for its allocation must
    never be sent (it would copy blocks now someone else's)."""
    rig = make_rig(served=True, save_wait_s=0.005)
    gate = rig.store.stall("allocate")
    request = rig.request("r", [*PROMPT, *range(90000, 90100)])  # a chunked prefill
    assert rig.admit(request) == 0
    assert rig.step([(request, 0, 160)]).meta.saves == []
    step = rig.step(preempted=[request])
    assert step.meta.saves == []
    assert rig.counts()["save_preempted"] == 5
    gate.set()
    rig.until(lambda: rig.store.calls["abort"] == 1, what="the late allocation aborted")
    rig.until(lambda: rig.write_leases() == 0 and rig.writing_bytes() == 0)
    assert all(rig.step().meta.saves == [] for _ in range(3))
    assert rig.held(PROMPT) == []


def test_a_preempted_request_saves_its_chunks_once_it_recomputes_them(make_rig) -> None:
    """The save dropped at the preemption copied nothing: the recompute saves those chunks
    (``saved_upto`` moved back to the dropped save's first chunk)."""
    rig = make_rig(served=True, save_wait_s=0.005)
    gate = rig.store.stall("allocate")
    tokens = [*PROMPT, *range(90000, 90100)]  # 260 tokens: eight chunks
    request = rig.request("r", tokens)
    assert rig.admit(request) == 0
    rig.step([(request, 0, 160)])  # the save of chunks 0-4 waits for pool space
    rig.step(preempted=[request])  # ... and is dropped
    gate.set()
    rig.until(lambda: rig.write_leases() == 0 and rig.store.calls["abort"] == 1)
    request.num_computed_tokens = 0
    assert rig.admit(request) == 0
    rig.step([(request, 0, request.num_tokens)], finished=[request])  # all recomputed
    rig.steps_until(lambda: len(rig.held(tokens)) >= 3 and rig.write_leases() == 0)
    assert rig.held(tokens) == list(range(8))


def test_a_preempted_request_recomputing_at_once_saves_its_chunks(make_rig) -> None:
    """The dropped save's pool space came after its step's wait; its abort is a store call off
    the scheduler thread (here a slow one, stalled until the recompute's step has run). The
    recompute's allocation must not run before it, or it finds the chunks still IN_PROGRESS
    under the aborted lease and skips them: they would never be saved."""
    rig = make_rig(served=True, save_wait_s=0.005)
    allocate = rig.store.stall("allocate")
    tokens = [*PROMPT, *range(90000, 90100)]  # 260 tokens: eight chunks
    request = rig.request("r", tokens)
    assert rig.admit(request) == 0
    assert rig.step([(request, 0, 160)]).meta.saves == []  # chunks 0-4 wait for pool space
    allocate.set()
    (late,) = rig.sched.saves._waiting
    rig.until(late.future.done, what="the late pool space")
    abort = rig.store.stall("abort")
    rig.step(preempted=[request])  # the save is dropped before it was sent
    request.num_computed_tokens = 0
    assert rig.admit(request) == 0
    rig.step([(request, 0, request.num_tokens)], finished=[request])  # recomputed at once
    abort.set()  # the abort completes only now
    rig.steps_until(lambda: rig.held(tokens) == list(range(8)) and rig.write_leases() == 0)
    counts = rig.counts()
    assert counts["save_preempted"] == 5
    assert counts.get("save_in_progress", 0) == 0  # never met the aborted lease
