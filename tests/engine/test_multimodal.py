"""Prompts with images, in a real vision-language model (a tiny random Idefics3) on vLLM's CPU
build: a chunk overlapping an image is keyed by the image (docs/keys/spec.md), so the next turn
about the same image hits its chunks exactly, while another image at the same placeholder
positions, or the same text without the image, hits only the chunks before it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.testing.models import vllm_env
from kvtier.testing.vision_models import (
    FIRST_TEXT_ID,
    IMAGE_SPAN,
    IMAGE_TOKEN_ID,
    make_tiny_idefics3,
)
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

pytestmark = pytest.mark.vllm

CHUNK = 64
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TEXT_ID, 500) for _ in range(n)]


def hit_tokens(prompt_len: int, chunks_held: int) -> int:
    """What a load may cover: whole chunks held, never the prompt's last token."""
    return min(chunks_held, (prompt_len - 1) // CHUNK) * CHUNK


def assert_exact(reference: list[dict], got: list[dict]) -> None:
    for ref, out in zip(reference, got, strict=True):
        assert out["tokens"] == ref["tokens"]
        assert out["logprobs"] == ref["logprobs"]  # bit-exact


def test_image_prompts_hit_exactly_and_only_with_their_image(tmp_path: Path, run_dir: Path) -> None:
    model = make_tiny_idefics3(tmp_path / "idefics3")
    rng = random.Random(7)
    pre, post, later, other = text(rng, 100), text(rng, 150), text(rng, 80), text(rng, 150)
    # the image's span [100, 119) lies in chunk 1: chunk 0 is text the image cannot change
    with_image = [*pre, IMAGE_TOKEN_ID, *post]  # 269 tokens once the image is expanded
    red = {"tokens": with_image, "image": 1}
    blue = {"tokens": with_image, "image": 2}  # another image, same placeholder positions
    red_next_turn = {"tokens": with_image + later, "image": 1}
    no_image = pre + post
    other_text = pre + other
    first = [red, no_image]
    second = [blue, red_next_turn, other_text]
    phases = [
        {"op": "generate", "prompts": first, "prompt_logprobs": True},  # computed and saved
        {"op": "reset_prefix_cache"},
        {"op": "generate", "prompts": first},  # from DRAM
        {"op": "metrics"},
        # from DRAM, each alone (vLLM's own cache emptied first): only what their inputs share
        *[
            op
            for p in second
            for op in ({"op": "reset_prefix_cache"}, {"op": "generate", "prompts": [p]})
        ],
        {"op": "metrics"},
        {"op": "generate", "prompts": second, "prompt_logprobs": True},  # computed
    ]
    extra = {"chunk_tokens": CHUNK, "min_hit_tokens": {"cpu": CHUNK}}
    spec = {
        "model": str(model),
        "phases": phases,
        "kv_transfer_config": kvtier_transfer_config(extra),
        "engine_args": {"limit_mm_per_prompt": {"image": 1}},
    }
    env = vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir))
    results = run_vllm(spec, env)
    reference, dram, before, after, computed = (results[i] for i in (0, 2, 3, -2, -1))
    loaded = [out for i in (5, 7, 9) for out in results[i]]
    image_len = len(with_image) - 1 + IMAGE_SPAN
    assert [r["num_cached_tokens"] for r in reference + computed] == [0] * 5  # not read
    assert reference[0]["logprobs"] != computed[0]["logprobs"]  # the image matters
    assert_exact(reference, dram)
    assert [r["num_cached_tokens"] for r in dram] == [
        hit_tokens(image_len, 4),
        hit_tokens(len(no_image), 4),
    ]
    assert_exact(computed, loaded)
    # blue and the other text share only chunk 0 with what was saved; the next turn about the
    # red image every chunk of the red prompt (4 of its 5 are whole)
    assert [r["num_cached_tokens"] for r in loaded] == [CHUNK, 4 * CHUNK, CHUNK]
    assert after[HOST] - before[HOST] == CHUNK + 4 * CHUNK + CHUNK
    assert after["vllm:kvtier_load_error_blocks"] == 0
