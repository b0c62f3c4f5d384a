"""Multimodal prompts are cached: a chunk overlapping an item's placeholder tokens is keyed by
the item as well (``core/keys.py`` ``media_extra``, as vLLM's own prefix cache keys its
blocks), so a conversation about an image hits on its next turn and another image at the same
placeholder positions never shares KV.

vLLM's real ``Scheduler`` drives the connector (``support/engine_rig.py``); its stand-in model
computes an image's positions from the image's identifier, not from its placeholder ids, and
checks every page a step attends to: KV of one image served to a prompt with another is
reported wrong. (A real vision-language model: not made at test time here, see
docs/connector.md's support matrix.)
"""

from __future__ import annotations

from pathlib import Path

from support.engine_rig import EngineRig

CHUNK = 32
TEXT = list(range(4, 44))
PLACEHOLDERS = [9] * 96  # positions 40-135: image A's 64 placeholders from 40, or from 72


def image(identifier: str, offset: int = 40, length: int = 64) -> list:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))]


def first_turn(rig: EngineRig) -> list[int]:
    """A prompt about image A: stored, then gone from vLLM's own cache."""
    prompt = TEXT + PLACEHOLDERS + list(range(100, 168))  # 204 tokens: 6 whole chunks
    rig.add("turn-1", prompt, mm_features=image("image-a"))
    rig.run()
    rig.settle()
    assert rig.counters["committed_chunks"] == 204 // CHUNK
    assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
    return prompt


def start_of(reports: list, req_id: str) -> int:
    return next(r.starts[req_id] for r in reports if req_id in r.starts)


def test_the_next_turn_about_the_same_image_hits(tmp_path: Path) -> None:
    rig = EngineRig(tmp_path, encoder_budget=4096)
    try:
        prompt = first_turn(rig)
        turn = rig.add("turn-2", prompt + list(range(300, 350)), mm_features=image("image-a"))
        reports = rig.run()
        assert start_of(reports, "turn-2") == 6 * CHUNK  # every stored chunk, image included
        assert rig.counters["cpu_hit_tokens"] == 6 * CHUNK
        assert rig.wrong == []
        assert turn.output_token_ids
    finally:
        rig.close()


def test_another_image_at_the_same_positions_shares_nothing_from_the_image_on(
    tmp_path: Path,
) -> None:
    """Same token ids, same placeholder positions, another image: only the chunk before the
    image is shared; the chunk the image starts in and every later one are not."""
    rig = EngineRig(tmp_path, encoder_budget=4096)
    try:
        prompt = first_turn(rig)
        other = rig.add("other", prompt + list(range(300, 350)), mm_features=image("image-b"))
        reports = rig.run()
        assert start_of(reports, "other") == CHUNK  # chunk 0 (tokens 0-31) only
        assert rig.wrong == []
        assert other.output_token_ids
    finally:
        rig.close()


def test_the_same_image_elsewhere_in_the_prompt_shares_nothing_from_it_on(tmp_path: Path) -> None:
    """The same token ids and the same image, its placeholders 32 positions later: other KV
    (the image sits at other positions), so other keys from the first chunk it touches."""
    rig = EngineRig(tmp_path, encoder_budget=4096)
    try:
        prompt = first_turn(rig)
        rig.add("moved", prompt, mm_features=image("image-a", offset=72))
        reports = rig.run()
        assert start_of(reports, "moved") == CHUNK  # chunk 1 (32-63) held image A before
        assert rig.wrong == []
    finally:
        rig.close()
