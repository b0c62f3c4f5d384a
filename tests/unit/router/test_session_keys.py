"""A session's next turn reuses its last prompt's chunk keys (router/session_keys.py): the
keys are always exactly ``prompt_keys`` of the prompt, whatever the session sends next."""

from __future__ import annotations

import random

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.router.session_keys import SessionKeys

NS = Namespace(model="m", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=16)
OTHER = NS.model_copy(update={"model": "other"})


def test_a_growing_conversation_hashes_only_its_new_chunks() -> None:
    table = SessionKeys()
    rng = random.Random(0)
    prompt: list[int] = []
    for turn in range(8):
        prompt = prompt + [rng.randrange(50_000) for _ in range(rng.randrange(5, 60))]
        assert table.keys(NS, NS.root_key(), prompt, "s1") == prompt_keys(NS, prompt), turn
    assert table.reused > table.hashed  # most chunks came from the last turn


def test_a_changed_history_or_another_namespace_is_keyed_afresh() -> None:
    table = SessionKeys()
    prompt = list(range(100, 100 + 16 * 6))
    table.keys(NS, NS.root_key(), prompt, "s1")
    edited = [7, *prompt[1:]]  # the first token changed: no key of the last prompt applies
    assert table.keys(NS, NS.root_key(), edited, "s1") == prompt_keys(NS, edited)
    shorter = edited[: 16 * 2 + 3]
    assert table.keys(NS, NS.root_key(), shorter, "s1") == prompt_keys(NS, shorter)
    assert table.keys(OTHER, OTHER.root_key(), shorter, "s1") == prompt_keys(OTHER, shorter)
    assert table.keys(NS, NS.root_key(), prompt, None) == prompt_keys(NS, prompt)


def test_the_table_keeps_at_most_its_token_bound() -> None:
    table = SessionKeys(max_tokens=16 * 10)
    for s in range(20):
        prompt = list(range(s, s + 16 * 4))
        assert table.keys(NS, NS.root_key(), prompt, f"s{s}") == prompt_keys(NS, prompt)
    assert table._tokens <= 16 * 10 and len(table._last) == 2
