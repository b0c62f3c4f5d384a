"""The store's shared view of its committed chunks (``kvtier.store.client.view``): it follows
the event log exactly, a reader never takes a torn or stale read for a miss it is not, and a
view whose store stopped saying it is alive (killed, frozen) or closed answers nothing."""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np

from kvtier.store.api.events import EventKind, StoreEvent
from kvtier.store.client.view import (
    COVERS_DISK,
    COVERS_POOL,
    HEADER_WORDS,
    ChunkView,
    ChunkViewWriter,
    add_held,
    follow_events,
    tag_of,
    view_bytes_for,
)

NS = bytes(range(16))


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"\x5a" * 8


def writer(
    max_chunks: int = 256, max_batch_keys: int = 64, covers: int = COVERS_POOL
) -> ChunkViewWriter:
    words = np.zeros(view_bytes_for(max_chunks) // 8, dtype=np.uint64)
    return ChunkViewWriter(
        words, epoch=7, max_batch_keys=max_batch_keys, max_age_s=5.0, covers=covers
    )


def reader_of(w: ChunkViewWriter) -> ChunkView:
    return ChunkView(w._words)  # a second reader over the same words, as an engine maps them


def test_the_view_follows_stored_removed_and_cleared() -> None:
    w = writer()
    observe = follow_events(w)
    r = reader_of(w)
    keys = [key(i) for i in range(8)]
    assert r.valid() and r.epoch == 7
    assert r.misses(NS, keys) and r.prefix_len(NS, keys) == 0
    observe([StoreEvent(EventKind.STORED, NS, tuple(keys[:5]))])
    assert r.prefix_len(NS, keys) == 5 and not r.misses(NS, keys)
    assert r.misses(bytes(16), keys)  # the same keys in another namespace: other tags
    observe([StoreEvent(EventKind.REMOVED, NS, (keys[2],))])
    assert r.prefix_len(NS, keys) == 2
    observe([StoreEvent(EventKind.CLEARED)])
    assert r.misses(NS, keys)


def test_a_view_of_pool_and_disk_holds_a_chunk_until_both_lost_it() -> None:
    """With the disk tier covered, a chunk spilled to disk and then evicted from the pool
    stays present (the store can still serve it); it leaves when the disk drops it too. A
    pool-only view ignores the disk's events, as before."""
    w = writer(covers=COVERS_POOL | COVERS_DISK)
    observe = follow_events(w)
    r = reader_of(w)
    keys = [key(i) for i in range(4)]
    assert r.covers_disk and not reader_of(writer()).covers_disk
    observe([StoreEvent(EventKind.STORED, NS, tuple(keys))])  # committed in the pool
    observe([StoreEvent(EventKind.STORED, NS, tuple(keys[:2]), tier="disk")])  # spilled
    observe([StoreEvent(EventKind.REMOVED, NS, tuple(keys))])  # evicted from the pool
    assert r.prefix_len(NS, keys) == 2
    observe([StoreEvent(EventKind.STORED, NS, (keys[0],))])  # loaded back into the pool
    observe([StoreEvent(EventKind.REMOVED, NS, (keys[0], keys[1]), tier="disk")])
    assert r.prefix_len(NS, keys) == 1  # keys[0] is in the pool still; keys[1] is gone
    observe([StoreEvent(EventKind.REMOVED, NS, (keys[0],), tier="disk")])  # not on disk now
    assert r.prefix_len(NS, keys) == 1
    observe([StoreEvent(EventKind.CLEARED)])  # the store cleared: pool and disk
    assert r.misses(NS, keys)

    pool_only = writer()
    follow_events(pool_only)([StoreEvent(EventKind.STORED, NS, tuple(keys), tier="disk")])
    assert reader_of(pool_only).misses(NS, keys)


def test_disk_chunks_found_at_start_are_seeded_and_follow_later_events() -> None:
    w = writer(covers=COVERS_POOL | COVERS_DISK)
    observe = follow_events(w)
    r = reader_of(w)
    add_held(w, {NS: [key(1), key(2)]}, COVERS_DISK)
    observe([StoreEvent(EventKind.STORED, NS, (key(2),), tier="disk")])  # told again: once
    assert r.prefix_len(NS, [key(1), key(2)]) == 2
    observe([StoreEvent(EventKind.REMOVED, NS, (key(2),), tier="disk")])
    assert r.prefix_len(NS, [key(1), key(2)]) == 1


def test_tags_never_take_the_empty_or_removed_markers() -> None:
    for low in (0, 1):
        k = low.to_bytes(8, "little") + b"\0" * 8
        assert tag_of(bytes(16), k) >= 2


def test_churn_with_rebuilds_keeps_the_view_equal_to_the_set() -> None:
    """Random adds and removes in two tiers (tombstones pile up and force rebuilds): every
    key's presence answers as the union of two plain sets does."""
    rng = random.Random(3)
    w = writer(max_chunks=64, covers=COVERS_POOL | COVERS_DISK)
    live: dict[int, set[int]] = {COVERS_POOL: set(), COVERS_DISK: set()}
    for _ in range(4000):
        i = rng.randrange(200)
        tier = rng.choice((COVERS_POOL, COVERS_DISK))
        if i in live[tier] and rng.random() < 0.6:
            live[tier].discard(i)
            w.apply([], [tag_of(NS, key(i))], tier)
        elif len(live[COVERS_POOL] | live[COVERS_DISK]) < 64:
            live[tier].add(i)
            w.apply([tag_of(NS, key(i))], [], tier)
    r = reader_of(w)
    for i in range(200):
        held = i in live[COVERS_POOL] or i in live[COVERS_DISK]
        assert r.prefix_len(NS, [key(i)]) == (1 if held else 0), i


def test_a_read_during_a_write_is_not_taken_for_an_answer() -> None:
    """A reader that finds the sequence odd (the store mid-write) or moved retries, and gives
    up as 'unknown' (ask the store), never as a miss."""
    w = writer()
    w.apply([tag_of(NS, key(1))], [])
    r = reader_of(w)
    w._words[1] += 1  # the store stopped mid-write (odd)
    assert r.prefix_len(NS, [key(2)]) is None
    assert not r.misses(NS, [key(2)])
    w._words[1] += 1
    assert r.misses(NS, [key(2)])


def test_a_permanent_chunk_is_never_read_absent_while_the_store_churns() -> None:
    """The seqlock under contention: a writer thread adds and removes other chunks (rebuilding
    the table, which empties it for a moment); a reader must never answer that a chunk present
    all along is absent."""
    w = writer(max_chunks=32)
    w.apply([tag_of(NS, key(0))], [])
    r = reader_of(w)
    stop = threading.Event()

    def churn() -> None:
        i = 1
        while not stop.is_set():
            w.apply([tag_of(NS, key(i))], [tag_of(NS, key(i - 1))] if i > 1 else [])
            i += 1

    thread = threading.Thread(target=churn)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside each other's reads and writes
    thread.start()
    wrong = 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if r.prefix_len(NS, [key(0)]) == 0:
                wrong += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert wrong == 0


def test_a_store_that_stopped_saying_it_is_alive_or_closed_answers_nothing() -> None:
    w = writer()
    r = reader_of(w)
    assert r.misses(NS, [key(1)])
    w._words[5] -= int(10e9)  # its last word of life is 10 s old (killed or frozen)
    assert not r.misses(NS, [key(1)])
    w.alive()
    assert r.misses(NS, [key(1)])
    w.retire()  # closed
    assert not r.valid() and not r.misses(NS, [key(1)])


def test_a_batch_the_store_would_refuse_is_left_to_the_store() -> None:
    """More keys than ``store.max_batch_keys``: the store answers INVALID_ARGUMENT, so the view
    must not answer it as a miss."""
    w = writer(max_batch_keys=4)
    r = reader_of(w)
    assert r.misses(NS, [key(i) for i in range(4)])
    assert not r.misses(NS, [key(i) for i in range(5)])


def test_sizing_holds_one_chunk_per_pool_page_below_the_load_bound() -> None:
    for pages in (1, 1000, 65536):
        slots = view_bytes_for(pages) // 8 - HEADER_WORDS
        assert slots & (slots - 1) == 0 and pages <= 0.7 * slots


def test_an_overfull_view_answers_nothing_until_it_fits_again() -> None:
    """More chunks than slots (small chunks on a big disk): leaving some out would read as
    misses, so the view answers nothing (ask the store) until it holds half as many."""
    w = writer(max_chunks=64, covers=COVERS_POOL | COVERS_DISK)
    r = reader_of(w)
    slots = len(w._slots)
    tags = [tag_of(NS, key(i)) for i in range(slots)]
    w.apply(tags, [], COVERS_DISK)
    assert w.overfull and r.prefix_len(NS, [key(0)]) is None
    assert not r.misses(NS, [key(10_000)])  # not answered, though it is absent
    w.apply([], tags[: slots // 2], COVERS_DISK)  # still more than fits with room to spare
    assert w.overfull
    w.apply([], tags[slots // 2 : slots - slots // 4], COVERS_DISK)
    assert not w.overfull and r.covers_disk
    assert r.prefix_len(NS, [key(slots - 1)]) == 1 and r.misses(NS, [key(0)])
