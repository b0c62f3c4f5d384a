"""A Mamba hybrid's lookup against a real node store: chunks held whole (attention and the state
after their last token) and chunks held as their attention alone (vLLM wrote no state there,
the sibling namespace) make one run, and the hit ends on the last chunk held whole."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.connector.layout import FULL, MAMBA, GroupGeometry, KvGeometry, ModelIdentity
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.tiers import Tiers, connect

from support.helpers import StoreProcess, start_store_process

CHUNK, BLOCK, PAGE = 64, 32, 1024
GEOMETRY = KvGeometry(
    ("attn", "state"),
    BLOCK,
    PAGE,
    CHUNK,
    "t;state-last",
    (GroupGeometry(FULL, ("attn",), 2, source=1), GroupGeometry(MAMBA, ("state",), 1, source=0)),
)
IDENTITY = ModelIdentity("m", "", "bfloat16", 1, 1, tp_size=1, pp_size=1)
CONFIG = ConnectorConfig(chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, verify_loads=False)


@pytest.fixture
def store(run_dir: Path) -> Iterator[StoreProcess]:
    proc = start_store_process(run_dir, "16MiB")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def scheduler(store: StoreProcess) -> Iterator[ConnectorScheduler]:
    scheduler = ConnectorScheduler(
        CONFIG, GEOMETRY, IDENTITY, Tiers(connect(StoreConfig(address=store.address)))
    )
    scheduler.bind_blocks(lambda req_id: ([0] * 64, list(range(1, 65))), 0, lambda blocks: None)
    try:
        yield scheduler
    finally:
        scheduler.shutdown()
        scheduler.resolver.pool.close()


def _request(req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def _hit(scheduler: ConnectorScheduler, request) -> int:
    deadline = time.monotonic() + 10
    while (hit := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
        assert time.monotonic() < deadline
    return int(hit[0] or 0)


def _store(scheduler: ConnectorScheduler, tokens: list[int], pattern: str) -> None:
    """Chunk i of ``tokens`` held whole ("W"), as attention alone ("A") or not at all."""
    resolver = scheduler.resolver
    state = scheduler._state(_request(f"seed-{pattern}", tokens))
    whole, alone = resolver.namespaces(state)[0], resolver.namespaces(state, True)[0]
    keys = state.keys(0, len(pattern), CHUNK)
    for i, kind in enumerate(pattern):
        if kind in "WA":
            ns, size = (whole, GEOMETRY.chunk_bytes) if kind == "W" else (alone, 2 * PAGE)
            resolver.pool.put(ns, [keys[i]], [np.full(size, i, dtype=np.uint8)])


@pytest.mark.parametrize(
    ("pattern", "hit_chunks"),
    [
        ("WAWAA", 3),  # through attention-alone chunks to the last whole one
        ("AAWAW", 5),  # a run may start with chunks without state
        ("WWWWW", 5),  # every step ended on a chunk boundary
        ("AAAAA", 0),  # no state anywhere: nothing to continue from
        ("WA-W", 1),  # a hole ends the run, cut back to its last whole chunk
        ("AW-W", 2),
    ],
)
def test_the_hit_runs_through_both_kinds_and_ends_on_a_whole_chunk(
    scheduler: ConnectorScheduler, pattern: str, hit_chunks: int
) -> None:
    tokens = list(range(4, 4 + 6 * CHUNK + 1))
    _store(scheduler, tokens, pattern)
    assert GEOMETRY.attention_bytes == 2 * PAGE
    assert _hit(scheduler, _request(f"ask-{pattern}", tokens)) == hit_chunks * CHUNK


def test_a_chunk_held_only_as_attention_is_no_known_miss(scheduler: ConnectorScheduler) -> None:
    tokens = list(range(9000, 9000 + 3 * CHUNK + 1))
    _hit(scheduler, _request("registers", list(range(20, 20 + 2 * CHUNK + 1))))  # namespaces
    _store(scheduler, tokens, "AW")
    assert _hit(scheduler, _request("ask", tokens)) == 2 * CHUNK  # the view did not say miss
    assert scheduler.take_stats().get("lookups_known_miss", 0) == 0


def test_the_hit_ends_on_a_whole_chunk_before_the_prompts_last_block(
    scheduler: ConnectorScheduler,
) -> None:
    """A prompt of exactly five chunks: a hit never covers its last block, so it can end at
    chunk 4 at most; held as attention alone there, the hit ends at chunk 3 (held whole),
    not at chunk 4, whose state vLLM would then ask a load for."""
    tokens = list(range(7000, 7000 + 5 * CHUNK))
    _store(scheduler, tokens, "WAWAW")
    assert _hit(scheduler, _request("exact", tokens)) == 3 * CHUNK
