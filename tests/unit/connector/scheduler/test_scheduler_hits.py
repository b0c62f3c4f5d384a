"""Hit tokens (``cpu_hit_tokens``, ``remote_hit_tokens``) count each load the workers report
done exactly once, whatever the order of its report and its request's end: vLLM frees a
request that stopped in a step (``request_finished``) before it hands the connector that
step's worker output, so a request finishing in its load's step is finished before its load
is reported. A load whose request was aborted before the load completed is no hit, nor is a
failed one (``test_scheduler_epochs.py``)."""

from __future__ import annotations

from kvtier.connector.metadata import KvtierWorkerMetadata

PROMPT = list(range(6000, 6160))  # 160 tokens: five chunks
TAIL = list(range(6500, 6533))  # 33 tokens more: the hit stops at the prompt's 160th


def test_a_request_finishing_in_its_load_step_counts_its_hit(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.admit(request) == 160
    step = rig.step([(request, 160, len(TAIL))], finished=[request])  # finished, then reported
    assert step.worker_meta is not None and "r" in step.worker_meta.loaded
    assert rig.counts()["cpu_hit_tokens"] == 160
    rig.step()
    assert rig.counts()["cpu_hit_tokens"] == 160
    assert rig.read_leases() == 0


def test_a_load_reported_before_its_request_finishes_counts_once(rig) -> None:
    """Reported, then finished; and a second report of the same load (another TP rank's, a
    step later) counts nothing more."""
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.admit(request) == 160
    scheduled = [(request, 160, len(TAIL))]
    rig.output(rig.run_workers(rig.build(scheduled), scheduled), scheduled)
    assert rig.counts()["cpu_hit_tokens"] == 160
    rig.sched.on_worker_output(KvtierWorkerMetadata(loaded={"r": {1}}))
    assert rig.finish(request) is False
    rig.step()
    assert rig.counts()["cpu_hit_tokens"] == 160
    assert rig.read_leases() == 0


def test_an_async_load_counts_when_reported_and_once(make_rig) -> None:
    rig = make_rig(load_mode="async")
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.sched.get_num_new_matched_tokens(request, 0) == (160, True)
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 160)
    step = rig.step()  # the request waits for its KV: nothing of it is scheduled
    assert step.finished_recving == {"r"}
    assert rig.counts()["cpu_hit_tokens"] == 160
    rig.step([(request, 160, len(TAIL))], finished=[request])
    assert rig.counts()["cpu_hit_tokens"] == 160


def test_an_async_load_aborted_before_it_completes_is_no_hit(make_rig) -> None:
    rig = make_rig(load_mode="async")
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + TAIL)
    assert rig.sched.get_num_new_matched_tokens(request, 0) == (160, True)
    rig.sched.update_state_after_alloc(request, (rig.allocate(request),), 160)
    meta = rig.build()  # the request waits for its KV: nothing of it is scheduled
    assert rig.finish(request) is False  # aborted while the workers copy
    step = rig.output(rig.run_workers(meta))
    assert step.finished_recving == {"r"}  # the copy completed; no one computed over it
    assert rig.counts().get("cpu_hit_tokens", 0) == 0
    assert rig.read_leases() == 0
