"""A load planned against one store incarnation, or one namespace generation, is never applied
to another: the request recomputes instead, and nothing is copied out of a pool at offsets
that belonged to the store before it restarted.

The store is served (a restart only happens to a store in another process); ``restart``
stops it and starts a new incarnation with a new epoch and segment, and the connector's tier
learns of it from its next call (STALE_EPOCH, then a re-attach), as with the gRPC client.
"""

from __future__ import annotations

PROMPT = list(range(3000, 3160))  # 160 tokens: five chunks
TAIL = list(range(7000, 7033))


def test_a_load_planned_before_a_store_restart_is_never_applied(make_rig) -> None:
    rig = make_rig(served=True)
    rig.seed(PROMPT)
    old_epoch = rig.pool.epoch
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160  # leased in the first incarnation
    rig.store.restart()
    # the same schedule(): another waiting request's lookup meets the new incarnation
    assert rig.lookup(rig.request("other", range(9000, 9100))) == 0
    assert rig.pool.epoch != old_epoch
    blocks = rig.allocate(request)
    rig.sched.update_state_after_alloc(request, (blocks,), 160)
    step = rig.step([(request, 160, len(TAIL))])
    (job,) = step.meta.loads
    assert job.failed == "the store restarted between lookup and load"
    assert job.segments == {}  # no segment to copy from: the old extents are void
    assert step.invalid_block_ids == set(blocks[:10])  # vLLM recomputes the whole hit
    assert not any(rig.page_of(b).any() for b in blocks[:10])  # nothing was copied
    counts = rig.counts()
    assert counts["stale_epoch_loads"] == 1
    assert counts.get("cpu_hit_tokens", 0) == 0  # a load that failed is no hit
    assert rig.read_leases() == 0  # the new incarnation holds no lease of ours
    assert rig.lookup(request, 0) == 0  # recomputes: not offered external tokens again
    rig.step([(request, 0, request.num_tokens)], finished=[request])  # in the very next step
    rig.steps_until(lambda: rig.stored(PROMPT + TAIL) == 6)  # into the new incarnation
    assert rig.write_leases() == 0


def test_a_recompute_right_after_a_failed_load_saves_what_the_aborted_save_had(
    make_rig,
) -> None:
    """The failed load's step saved chunk 5 computed over KV never loaded: that save is
    aborted and vLLM recomputes in the very next step. The abort is a store call off the
    scheduler thread (here a slow one, stalled until the recompute's step has run); the
    recompute's allocation must not run before it, or it finds chunk 5 still IN_PROGRESS
    under the aborted lease and skips it: the chunk would never be saved again."""
    rig = make_rig(served=True, save_wait_s=1.0)  # chunk 5's pool space, in its own step
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160
    rig.store.restart()
    assert rig.lookup(rig.request("other", range(9000, 9100))) == 0  # the tier re-attaches
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 160)
    gate = rig.store.stall("abort")
    step = rig.step([(request, 160, len(TAIL))])
    assert len(step.meta.saves) == 1 and step.invalid_block_ids  # chunk 5, then tainted
    assert rig.lookup(request, 0) == 0
    step = rig.step([(request, 0, request.num_tokens)], finished=[request])
    gate.set()  # the abort completes only now
    rig.steps_until(lambda: rig.stored(PROMPT + TAIL) == 6 and rig.write_leases() == 0)
    counts = rig.counts()
    assert counts["saves_discarded_after_failed_load"] == 1
    assert counts.get("save_in_progress", 0) == 0  # the recompute never met the aborted lease


def test_a_load_sent_before_the_tier_saw_the_restart_fails_in_the_worker(make_rig) -> None:
    """Nothing called the store between the lookup and the load: the job still names the old
    incarnation's segment, which the worker finds gone; it copies nothing."""
    rig = make_rig(served=True)
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    blocks = rig.allocate(request)
    rig.sched.update_state_after_alloc(request, (blocks,), rig.lookup(request))
    rig.store.restart()
    step = rig.step([(request, 160, len(TAIL))])
    (job,) = step.meta.loads
    assert job.failed == "" and job.segments  # the scheduler could not know yet
    assert step.invalid_block_ids == set(blocks[:10])
    assert not any(rig.page_of(b).any() for b in blocks[:10])
    assert rig.counts().get("cpu_hit_tokens", 0) == 0
    assert rig.lookup(request, 0) == 0


def test_a_save_allocated_before_a_restart_is_never_committed(make_rig) -> None:
    """The store restarts between the allocation and the copy: the workers cannot reach the
    pages they were given, report the save failed, and nothing is committed anywhere."""
    rig = make_rig(served=True, save_wait_s=1.0)
    request = rig.request("r", PROMPT)
    assert rig.admit(request) == 0
    step = rig.step(
        [(request, 0, len(PROMPT))],
        finished=[request],
        before_workers=lambda meta: rig.store.restart(),
    )
    assert len(step.meta.saves) == 1
    assert step.worker_meta is not None and step.worker_meta.save_failed
    assert step.held == {"r": False}
    counts = rig.counts()
    assert counts["save_errors"] == 5
    assert counts.get("committed_chunks", 0) == 0
    assert rig.held(PROMPT) == []  # the new incarnation holds none of it
    assert rig.write_leases() == 0


def test_a_run_leased_before_a_namespace_bump_is_never_loaded(rig) -> None:
    """``reset_prefix_cache`` with a shared store bumps the namespace: a request that was
    looked up before it and waited for blocks is looked up afresh, in the new namespace."""
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160
    rig.step()  # no blocks for it this step: it waits
    assert rig.sched.bump_namespace() == 1
    assert rig.lookup(request) == 0  # the old run is not this namespace's
    assert rig.read_leases() == 0  # and its lease went with it
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 0)
    step = rig.step([(request, 0, request.num_tokens)], finished=[request])
    assert step.meta.loads == []
    assert rig.stored(PROMPT + TAIL) == 6  # saved again under the new namespace
    rig.settle(PROMPT + TAIL)
    assert rig.lookup(rig.request("next", PROMPT + TAIL)) == 192


def test_a_lookup_in_flight_across_a_namespace_bump_is_not_used(make_rig) -> None:
    rig = make_rig(served=True)
    rig.seed(PROMPT)
    gate = rig.store.stall("lookup")
    request = rig.request("r", PROMPT + TAIL)
    assert rig.sched.get_num_new_matched_tokens(request, 0) == (None, False)
    rig.sched.bump_namespace()
    gate.set()
    assert rig.lookup(request) == 0  # the old namespace's answer is dropped
    rig.until(lambda: rig.read_leases() == 0)  # ... and what it leased released
