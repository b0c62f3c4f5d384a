"""A load the workers report failed never becomes KV someone reads later.

A sync load fails after vLLM scheduled the step over its blocks (here: a chunk's bytes are
damaged in the pool between lookup and copy, and the worker's checksum catches it), so that
step computes over blocks that were never filled. The rule (docs/connector.md, "Exactness"):
the workers report every block of the load, vLLM recomputes them; the scheduler side aborts
every save computed over any of them (the request's own, or another request's sharing them),
takes them and everything after them out of vLLM's prefix cache, deletes exactly the chunk
that failed its checksum, never offers the request external tokens again, and saves its
chunks once a step of it has recomputed them.
"""

from __future__ import annotations

import pytest

PROMPT = list(range(4000, 4160))  # 160 tokens: five chunks, ten blocks
EXTRA = list(range(8000, 8065))  # 65 more: two chunks completed in the load's step
OTHER = list(range(8500, 8565))


def damage_last_chunk(rig):
    """Overwrite the first bytes of each load's last chunk in the pool, after the lookup read
    its checksum: the worker's verification fails that load."""

    def damage(meta) -> None:
        for job in meta.loads:
            offset, _ = job.chunks[0][-1].extents[0]
            rig.pool.segment.write([(offset, 64)], b"\xff" * 64)

    return damage


def test_a_failed_load_taints_the_steps_saves_and_leaves_the_prefix_cache(rig) -> None:
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + EXTRA)
    assert rig.admit(request) == 160
    blocks = rig.blocks["r"]
    step = rig.step([(request, 160, len(EXTRA))], before_workers=damage_last_chunk(rig))
    assert [len(s.chunks[0]) for s in step.meta.saves] == [2]  # chunks 5 and 6 were sent
    assert step.worker_meta is not None and step.worker_meta.saved  # ... and copied
    assert step.invalid_block_ids == set(blocks[:10])  # vLLM recomputes the whole load
    assert "r" in rig.wrong  # that step computed over the damaged pages
    # the pool: the seed's good chunks, not the damaged one, nothing computed over it
    assert rig.held(PROMPT + EXTRA) == [0, 1, 2, 3]
    counts = rig.counts()
    assert counts["load_failed_requests"] == 1
    assert counts["saves_discarded_after_failed_load"] == 2
    assert counts.get("committed_chunks", 0) == 0
    assert counts["corrupt_chunks_deleted"] == 1
    assert rig.evicted == set(blocks)  # the failed blocks and all computed over them
    assert rig.write_leases() == 0 and rig.writing_bytes() == 0  # aborted, not left over
    assert rig.read_leases() == 0
    assert rig.lookup(request, 0) == 0  # the same bytes are not offered again
    # vLLM recomputes from the first failed block; that step saves what it computed
    assert request.num_computed_tokens == 0
    rig.step([(request, 0, request.num_tokens)], finished=[request])
    assert rig.held(PROMPT + EXTRA) == list(range(7))


def test_a_request_sharing_the_failed_blocks_saves_nothing_over_them(rig) -> None:
    """vLLM cached r1's blocks when it allocated them for the sync load: r2, scheduled in the
    same step, takes them as its own prefix-cache hit and computes its suffix over them."""
    rig.seed(PROMPT)
    r1 = rig.request("r1", PROMPT + EXTRA)
    assert rig.admit(r1) == 160
    r2 = rig.request("r2", PROMPT + OTHER)
    assert rig.lookup(r2, local_hit=160) == 0  # nothing stored past vLLM's own hit
    rig.sched.update_state_after_alloc(r2, (rig.allocate(r2, shared=rig.blocks["r1"][:10]),), 0)
    step = rig.step(
        [(r1, 160, len(EXTRA)), (r2, 160, len(OTHER))], before_workers=damage_last_chunk(rig)
    )
    assert len(step.meta.saves) == 2
    assert rig.held(PROMPT + OTHER) == [0, 1, 2, 3]
    assert rig.held(PROMPT + EXTRA) == [0, 1, 2, 3]
    assert rig.counts()["saves_discarded_after_failed_load"] == 4
    assert rig.evicted == set(rig.blocks["r1"]) | set(rig.blocks["r2"])
    assert rig.write_leases() == 0


def test_a_request_resuming_inside_what_its_load_left_unfilled_saves_from_there(rig) -> None:
    """r is preempted before it recomputed and resumes on a device hit over part of the
    failed load's blocks (vLLM should have dropped them; this is the connector's own half):
    it saves only chunks it computes whole from where it resumed."""
    rig.seed(PROMPT)
    request = rig.request("r", PROMPT + EXTRA)
    rig.admit(request)
    rig.step([(request, 160, len(EXTRA))], before_workers=damage_last_chunk(rig))
    rig.step(preempted=[request])
    assert rig.lookup(request, local_hit=128) == 0
    blocks = rig.allocate(request, shared=rig.blocks["r"][:8])  # 128 tokens, loaded intact
    rig.sched.update_state_after_alloc(request, (blocks,), 0)
    step = rig.step([(request, 128, request.num_tokens - 128)], finished=[request])
    (save,) = step.meta.saves
    assert [b for c in save.chunks[0] for b in c.block_ids] == blocks[8:14]  # chunks 4-6
    assert rig.held(PROMPT + EXTRA) == list(range(7))


def test_external_tokens_never_offered_become_load_errors(rig) -> None:
    """vLLM counts more external tokens than the connector offered (it never should): the
    blocks are failed, not left unfilled as if loaded."""
    request = rig.request("r", PROMPT + EXTRA)
    assert rig.lookup(request) == 0
    blocks = rig.allocate(request)
    rig.sched.update_state_after_alloc(request, (blocks,), 32)
    step = rig.step([(request, 32, request.num_tokens - 32)])
    assert step.invalid_block_ids == set(blocks[:2])
    assert rig.lookup(request, 0) == 0


@pytest.mark.parametrize("held", [None, 16], ids=["asked", "held-ahead"])
def test_the_corrupt_chunk_is_gone_before_the_recompute_saves_it_again(
    make_rig, held: int | None
) -> None:
    """The delete of the chunk that failed its checksum is a store call off the scheduler
    thread (here a slow one, stalled until the recompute's step has run). The recompute's
    allocation must not run before it: it would find the damaged chunk still there (EXISTS),
    not save the clean copy, and leave a hole in the prefix once the delete ran. Into pool
    space held ahead, the same for its commit: run before the delete, it would find the
    name taken and free the clean copy."""
    rig = make_rig(served=True, save_wait_s=0.05, save_held_chunks=held)
    rig.seed(PROMPT)
    if held:
        rig.steps_until(lambda: rig.sched.saves.slab.held() >= 9, "space held ahead")
    request = rig.request("r", PROMPT + EXTRA)
    assert rig.admit(request) == 160
    gate = rig.store.stall("delete")
    step = rig.step([(request, 160, len(EXTRA))], before_workers=damage_last_chunk(rig))
    assert step.invalid_block_ids
    rig.step([(request, 0, request.num_tokens)], finished=[request])
    gate.set()  # the delete completes only now
    for calls in (rig.sched._alloc, rig.sched._ops):  # every store call queued so far is made
        calls.submit(lambda: None).result()
    rig.steps_until(lambda: rig.stored(PROMPT + EXTRA) == 7 and rig.write_leases() == 0)
    assert rig.counts()["corrupt_chunks_deleted"] == 1
    if held:
        assert rig.counts()["save_held_space"] == 2 + 7  # the failing step's, the recompute's
