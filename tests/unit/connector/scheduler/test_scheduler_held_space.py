"""Saves into pool space the connector holds ahead (``SaveSlab``: 8 chunks here, set
explicitly: unset it holds none for the rig's full-attention model), driven through the hooks
in vLLM's order with a store served from another thread: the copy goes out with the step that
computed the chunks however slow the store's allocations, the chunks commit under their own
keys with exactly their KV, and no placeholder page is left behind (a duplicate, a failed
load's taint, a store restart, space too close to its lease's end, shutdown)."""

from __future__ import annotations

from dataclasses import replace

from kvtier.connector.save_slab import SaveSlab

PROMPT = list(range(50000, 50160))  # 160 tokens: five chunks (one 4 KiB pool page each)
OTHER = list(range(60000, 60160))


def slab_of(rig) -> SaveSlab:
    slab = rig.sched.saves.slab
    assert slab is not None
    return slab


def warm(rig, tokens: list[int], at_least: int = 5) -> None:
    """One request saves ``tokens`` (its step asks the store: nothing is held yet) and the
    slab fills behind it."""
    rig.seed(tokens)
    rig.steps_until(lambda: slab_of(rig).held() >= at_least, "space held ahead")
    rig.counters.clear()


def test_a_step_saves_into_held_space_while_the_store_is_slow_to_allocate(make_rig) -> None:
    rig = make_rig(served=True, save_held_chunks=8)
    warm(rig, OTHER)
    gate = rig.store.stall("allocate")  # every allocation waits from now on
    request = rig.request("r", PROMPT)
    assert rig.admit(request) == 0
    step = rig.step([(request, 0, len(PROMPT))], finished=[request])
    assert len(step.meta.saves) == 1  # out with the step that computed the chunks
    assert step.held == {"r": False}  # nothing waits: vLLM frees the blocks now
    # the commit runs behind the store's calls queued before it (the slab's refill, stalled)
    gate.set()
    rig.steps_until(lambda: rig.stored(PROMPT) == 5, "the held save's commit")  # bytes checked
    counts = rig.counts()
    assert counts["save_held_space"] == 5
    assert counts.get("save_deferred", 0) == 0 and counts.get("save_errors", 0) == 0
    rig.steps_until(lambda: slab_of(rig).held() >= 5, "the refill")
    assert rig.writing_bytes() == 0 and rig.write_leases() == 0  # only the slab's own space


def test_a_chunk_stored_meanwhile_keeps_its_bytes_and_the_copy_is_freed(make_rig) -> None:
    rig = make_rig(served=True, save_held_chunks=12)
    warm(rig, OTHER, at_least=12)
    a, b = rig.request("a", PROMPT), rig.request("b", PROMPT)
    assert rig.admit(a) == 0 and rig.admit(b) == 0  # neither sees the other's chunks
    step = rig.step([(a, 0, len(PROMPT)), (b, 0, len(PROMPT))], finished=[a, b])
    assert len(step.meta.saves) == 2  # both copies go out
    rig.steps_until(lambda: rig.counts().get("save_held_duplicates", 0) == 5, "both commits")
    assert rig.counts()["committed_chunks"] == 5
    assert rig.stored(PROMPT) == 5  # exactly its KV
    rig.steps_until(lambda: rig.writing_bytes() == 0, "freed duplicates")


def test_a_held_save_computed_over_a_failed_load_is_given_back(make_rig) -> None:
    rig = make_rig(served=True, save_wait_s=0.05, save_held_chunks=8)
    warm(rig, PROMPT)
    request = rig.request("r", PROMPT + OTHER)
    assert rig.admit(request) == 160

    def failing(meta) -> None:  # the load's first chunk fails its checksum in the worker
        copies = meta.loads[0].chunks[0]
        copies[0] = replace(copies[0], checksum=copies[0].checksum ^ 1)

    step = rig.step([(request, 160, len(OTHER))], before_workers=failing)
    assert step.invalid_block_ids  # the load failed: vLLM recomputes from its first block
    assert len(step.meta.saves) == 1  # the step's new chunks were copied into held space
    counts = rig.counts()
    assert counts["save_held_space"] == 5
    assert counts["saves_discarded_after_failed_load"] == 5
    assert counts.get("committed_chunks", 0) == 0
    rig.steps_until(lambda: rig.writing_bytes() == 0, "the given-back space")
    assert rig.held(OTHER) == []  # none of those chunks, and none under another name
    assert rig.wrong == set()


def test_a_store_restart_voids_held_space(make_rig) -> None:
    rig = make_rig(served=True, save_held_chunks=8)
    warm(rig, OTHER)
    request = rig.request("r", PROMPT)
    assert rig.admit(request) == 0
    step = rig.step(
        [(request, 0, len(PROMPT))],
        finished=[request],
        before_workers=lambda meta: rig.store.restart(),
    )
    assert len(step.meta.saves) == 1  # copied into the old incarnation's pages
    assert rig.counts()["save_held_space"] == 5
    rig.steps_until(lambda: rig.counts().get("save_errors", 0) >= 1, "the refused commit")
    assert rig.counts().get("committed_chunks", 0) == 0
    assert rig.held(PROMPT) == []  # the new incarnation holds none of it
    # saves go on in the new incarnation (asked for, then from space held there)
    again = rig.request("again", OTHER + PROMPT)
    assert rig.admit(again) == 0
    rig.step([(again, 0, again.num_tokens)], finished=[again])
    rig.steps_until(lambda: rig.stored(OTHER + PROMPT) == 10, "saves after the restart")


def test_write_leases_too_short_to_hold_space_turn_it_off(make_rig) -> None:
    """Write leases of 10 s, less than a slot must have left to be taken (15 s): the slab
    gives its first space back and turns off (no churn of the store), and every save asks the
    store, as without it."""
    rig = make_rig(served=True, save_held_chunks=8, store={"write_ttl_s": 10})
    rig.seed(OTHER)
    slab = slab_of(rig)
    rig.steps_until(lambda: not slab.enabled, "the slab off")
    for i in range(3):
        tokens = list(range(70000 + 1000 * i, 70000 + 1000 * i + 160))
        request = rig.request(f"r{i}", tokens)
        assert rig.admit(request) == 0
        rig.step([(request, 0, len(tokens))], finished=[request])
        rig.steps_until(lambda t=tokens: rig.stored(t) == 5, "an asked-for save")
    assert rig.counts().get("save_held_space", 0) == 0
    stats = rig.store.inner.stats
    rig.until(lambda: stats()["write_leases"] == 0 and stats()["writing_bytes"] == 0)
    assert rig.store.calls["allocate"] == 1 + 1 + 3  # the seed's, the one refill, the saves'


def test_shutdown_gives_all_held_space_back(make_rig) -> None:
    rig = make_rig(served=True, save_held_chunks=8)
    warm(rig, OTHER)
    stats = rig.store.inner.stats
    assert stats()["writing_bytes"] == slab_of(rig).held() * 4096 > 0
    rig.sched.shutdown()
    assert stats()["write_leases"] == 0 and stats()["writing_bytes"] == 0


def test_unset_holds_space_only_for_a_model_whose_blocks_may_go(make_rig) -> None:
    """A full-attention model keeps its blocks while the request lives (a save sent a step
    later loses nothing): unset, nothing is held; an embedded store never holds any."""
    assert make_rig(served=True).sched.saves.slab is None
    assert make_rig(save_held_chunks=8).sched.saves.slab is None  # embedded


def test_a_save_larger_than_the_space_held_takes_it_and_asks_for_the_rest(make_rig) -> None:
    rig = make_rig(served=True, save_held_chunks=3, save_wait_s=1.0)
    warm(rig, OTHER, at_least=3)
    request = rig.request("r", PROMPT)  # five chunks: three held, two asked for
    assert rig.admit(request) == 0
    step = rig.step([(request, 0, len(PROMPT))], finished=[request])
    assert len(step.meta.saves) == 2  # both out with this step (the asked part waited)
    rig.steps_until(lambda: rig.stored(PROMPT) == 5, "both parts committed")  # bytes checked
    counts = rig.counts()
    assert counts["save_held_space"] == 3 and counts["save_held_short"] == 1
    assert counts["committed_chunks"] == 5
    rig.steps_until(lambda: rig.writing_bytes() == 0 and rig.write_leases() == 0, "no leftovers")
