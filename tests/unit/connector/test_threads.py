"""The scheduler thread never waits behind a store call another thread is making."""

from __future__ import annotations

import threading

from kvtier.core.config import StoreConfig
from kvtier.tiers import connect


def test_segment_ref_answers_while_a_reattach_waits_for_the_store(
    store_config: StoreConfig,
) -> None:
    """A lookup thread re-attaching to a store that is restarting (the call blocks) must not
    hold the lock the scheduler thread takes every step (``segment_ref``)."""
    pool = connect(store_config)
    release = threading.Event()
    entered = threading.Event()
    real = pool.store.reattach

    def frozen_reattach():  # the store is restarting: the call waits
        entered.set()
        release.wait(30)
        return real()

    pool.store.reattach = frozen_reattach
    epoch = pool.info.epoch
    lookup_thread = threading.Thread(target=pool.reattach)
    lookup_thread.start()
    try:
        assert entered.wait(10)
        answered: list[object] = []
        scheduler_thread = threading.Thread(target=lambda: answered.append(pool.segment_ref(epoch)))
        scheduler_thread.start()
        scheduler_thread.join(10)
        assert answered, "segment_ref waited behind the store call"
        assert answered[0] is not None
    finally:
        release.set()
        lookup_thread.join(10)
        pool.close()
