"""Every read lease the scheduler side takes at lookup is given back: when the load that used
it completes, when its request finishes or is aborted before loading, when vLLM does not take
the hit after all, when a newer lookup supersedes it, and at shutdown. What is checked is the
store's own count of read leases, which must come back to zero."""

from __future__ import annotations

import time

PROMPT = list(range(1000, 1160))  # 160 tokens: five chunks
TAIL = list(range(5000, 5033))  # 33 tokens more: the hit stops at the prompt's 160th


def test_leases_are_released_when_the_load_completes(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.admit(request) == 160
    assert rig.read_leases() == 1
    held_while_copying = []
    step = rig.step(
        [(request, 160, len(TAIL))],
        before_workers=lambda meta: held_while_copying.append(rig.read_leases()),
    )
    assert held_while_copying == [1]  # pinned while the workers copy
    assert step.invalid_block_ids == set()
    assert rig.wrong == set()  # the loaded pages hold exactly the prompt's KV
    assert rig.read_leases() == 0  # given back at the load's report, the request still runs
    assert rig.counts()["cpu_hit_tokens"] == 160


def test_a_request_finishing_in_its_load_step_releases_after_the_load(rig) -> None:
    """vLLM frees a request that stopped before it hands the connector the workers' output:
    the leases must outlive ``request_finished`` until the load is reported."""
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    rig.admit(request)
    scheduled = [(request, 160, len(TAIL))]
    step = rig.run_workers(rig.build(scheduled), scheduled)
    assert rig.finish(request) is False
    assert rig.read_leases() == 1  # the connector has not seen the load's report yet
    rig.sched.on_worker_output(step.worker_meta)
    assert rig.read_leases() == 0


def test_an_async_load_aborted_while_copying_releases_once_reported(make_rig) -> None:
    rig = make_rig(load_mode="async")
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.sched.get_num_new_matched_tokens(request, 0) == (160, True)
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 160)
    meta = rig.build()  # the request waits for its KV: nothing of it is scheduled
    assert rig.finish(request) is False  # aborted while the workers copy
    assert rig.read_leases() == 1
    step = rig.output(rig.run_workers(meta))
    assert step.finished_recving == {"r"}  # vLLM frees its blocks now
    assert rig.read_leases() == 0


def test_a_hit_never_allocated_is_released_when_the_request_is_aborted(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160
    rig.step()  # vLLM found no blocks for it: it waits
    assert rig.lookup(request) == 160  # asked again: the same leased run, no second lease
    assert rig.read_leases() == 1
    rig.step()
    assert rig.finish(request) is False
    assert rig.read_leases() == 0


def test_a_hit_vllm_does_not_take_is_released_at_allocation(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request) == 160
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 0)
    assert rig.read_leases() == 0
    step = rig.step([(request, 0, request.num_tokens)])
    assert step.meta.loads == []


def test_superseded_and_stale_lookups_release_their_leases(make_rig) -> None:
    rig = make_rig(load_lease_ttl_s=0.4)
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.lookup(request, 0) == 160
    # vLLM's own hit grew while the request waited (another request computed the prefix):
    # the connector looks up past it; the first run's lease goes
    assert rig.lookup(request, 64) == 96
    assert rig.read_leases() == 1
    time.sleep(0.25)  # the lease is past half its TTL: looked up and leased afresh
    assert rig.lookup(request, 64) == 96
    assert rig.read_leases() == 1
    rig.finish(request)
    assert rig.read_leases() == 0


def test_a_preempted_request_leases_afresh_and_leaks_nothing(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    rig.admit(request)
    rig.step([(request, 160, len(TAIL))])
    assert rig.read_leases() == 0
    rig.step(preempted=[request])  # its blocks are freed; it waits to start over
    request.num_computed_tokens = 0
    rig.settle(PROMPT + TAIL)  # the chunk it computed is in the pool now too
    assert rig.admit(request) == 192
    assert rig.read_leases() == 1
    step = rig.step([(request, 192, 1)], finished=[request])
    assert step.invalid_block_ids == set()
    assert rig.read_leases() == 0


def test_shutdown_gives_back_every_lease_still_held(rig) -> None:
    rig.seed(PROMPT)
    for i in range(3):
        assert rig.lookup(rig.request(f"w{i}", PROMPT + TAIL)) == 160
    assert rig.read_leases() == 3
    rig.sched.shutdown()
    assert rig.read_leases() == 0
