"""The router's tokenizer (``router/tokenize.py``): a session's turns encoded incrementally,
and a turn that extends the last one routed by that turn's ids and an estimated length."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.router.tokenize import PromptTokenizer
from kvtier.testing.models import _tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    out = tmp_path_factory.mktemp("tok")
    _tokenizer(512).save_pretrained(out)
    return PromptTokenizer(str(Path(out)))


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"t{rng.randrange(500)}" for _ in range(n))


def test_a_turn_extending_the_last_is_routed_by_its_ids(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "system", "content": words(0, 300)}]
    assert tokenizer.last_turn_ids({"messages": messages}, "s") is None  # nothing cached yet
    first = tokenizer.chat_ids({"messages": messages}, "s")
    messages = [*messages, {"role": "user", "content": words(1, 100)}]
    last = tokenizer.last_turn_ids({"messages": messages}, "s")
    assert last is not None
    ids, estimated = last
    assert ids == first  # the last turn's ids, unchanged
    actual = len(tokenizer.chat_ids({"messages": messages}))
    assert abs(estimated - actual) <= 0.1 * actual  # the new turn's length, estimated
    # the same turn again (a retry): its own ids once tokenized
    tokenizer.chat_ids({"messages": messages}, "s")
    ids, estimated = tokenizer.last_turn_ids({"messages": messages}, "s")  # type: ignore[misc]
    assert estimated == len(ids) == actual


def test_anything_but_an_extension_is_tokenized(tokenizer: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": words(2, 50)}]
    tokenizer.chat_ids({"messages": messages}, "t")
    edited = [{"role": "user", "content": words(3, 50)}, {"role": "user", "content": "t1"}]
    assert tokenizer.last_turn_ids({"messages": edited}, "t") is None  # history rewritten
    assert tokenizer.last_turn_ids({"messages": []}, "t") is None  # shorter
    longer = {"messages": [*messages, {"role": "user", "content": "t2"}]}
    assert tokenizer.last_turn_ids(longer, "t") is not None
    assert tokenizer.last_turn_ids({**longer, "add_generation_prompt": False}, "t") is None
    assert tokenizer.last_turn_ids(longer, "another session") is None


def test_an_older_turn_finishing_late_does_not_replace_a_newer(
    tokenizer: PromptTokenizer,
) -> None:
    turn1 = [{"role": "user", "content": words(4, 20)}]
    turn2 = [*turn1, {"role": "user", "content": words(5, 20)}]
    newer = tokenizer.chat_ids({"messages": turn2}, "u")
    tokenizer.chat_ids({"messages": turn1}, "u")  # a background encode of turn 1, late
    turn3 = [*turn2, {"role": "user", "content": "t3"}]
    assert tokenizer.last_turn_ids({"messages": turn3}, "u")[0] == newer  # type: ignore[index]


def test_the_proxy_routes_by_the_last_turn_and_tokenizes_after(
    tokenizer: PromptTokenizer,
) -> None:
    """``Proxy.prompt_ids`` as a request reaches it: the first turn tokenized before routing,
    the next routed by the first's ids while it is tokenized in the background; with
    ``route_by_last_turn`` off, every turn tokenized first."""
    import asyncio

    from kvtier.core.config import RouterConfig
    from kvtier.router.proxy import Proxy
    from kvtier.router.requests import CHAT_PATH

    def proxy(config: RouterConfig) -> Proxy:
        p = Proxy.__new__(Proxy)  # only what prompt_ids reads
        p.tokenizer, p.config, p._tokenizing, p._background = tokenizer, config, set(), set()
        return p

    async def turns(p: Proxy, session: str) -> list[tuple[list[int] | None, int | None]]:
        messages = [{"role": "user", "content": words(6, 200)}]
        out = []
        for turn in range(3):
            ids, _, counted = await p.prompt_ids(CHAT_PATH, {"messages": messages}, session)
            out.append((ids, counted))
            await asyncio.gather(*p._background)  # the background encode, done before the next
            messages = [*messages, {"role": "user", "content": words(7 + turn, 50)}]
        return out

    full = [tokenizer.chat_ids({"messages": m}) for m in _growing(3)]
    quick = asyncio.run(turns(proxy(RouterConfig()), "p"))
    assert quick[0] == (full[0], len(full[0]))
    for turn in (1, 2):  # the previous turn's ids, this turn's length estimated
        assert quick[turn][0] == full[turn - 1]
        assert abs(quick[turn][1] - len(full[turn])) <= 0.1 * len(full[turn])  # type: ignore[operator]
    eager = asyncio.run(turns(proxy(RouterConfig(route_by_last_turn=False)), "q"))
    assert eager == [(ids, len(ids)) for ids in full]


def _growing(n: int) -> list[list[dict]]:
    messages = [{"role": "user", "content": words(6, 200)}]
    out = []
    for turn in range(n):
        out.append(messages)
        messages = [*messages, {"role": "user", "content": words(7 + turn, 50)}]
    return out
