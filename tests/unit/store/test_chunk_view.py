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
    HEADER_WORDS,
    ChunkView,
    ChunkViewWriter,
    follow_events,
    tag_of,
    view_bytes_for,
)

NS = bytes(range(16))


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"\x5a" * 8


def writer(max_chunks: int = 256, max_batch_keys: int = 64) -> ChunkViewWriter:
    words = np.zeros(view_bytes_for(max_chunks) // 8, dtype=np.uint64)
    return ChunkViewWriter(words, epoch=7, max_batch_keys=max_batch_keys, max_age_s=5.0)


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


def test_tags_never_take_the_empty_or_removed_markers() -> None:
    for low in (0, 1):
        k = low.to_bytes(8, "little") + b"\0" * 8
        assert tag_of(bytes(16), k) >= 2


def test_churn_with_rebuilds_keeps_the_view_equal_to_the_set() -> None:
    """Random adds and removes (tombstones pile up and force rebuilds): every key's presence
    answers as a plain set's does."""
    rng = random.Random(3)
    w = writer(max_chunks=64)
    live: set[int] = set()
    for _ in range(4000):
        i = rng.randrange(200)
        if i in live and rng.random() < 0.6:
            live.discard(i)
            w.apply([], [tag_of(NS, key(i))])
        elif len(live) < 64:
            live.add(i)
            w.apply([tag_of(NS, key(i))], [])
    r = reader_of(w)
    for i in range(200):
        assert r.prefix_len(NS, [key(i)]) == (1 if i in live else 0), i


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
