"""A streaming-input session whose inputs change after it started: the connector follows them.

vLLM's real ``Scheduler`` drives the hooks (``support/engine_rig.py``): a session's next input
is added as the engine adds it (``add_request`` with the same id), and vLLM resumes the session
without asking the connector for a lookup - so every hook must notice the change itself. The
stand-in model computes an image's positions from the image, not from its placeholder ids:
a text prompt served an image's KV reads wrong KV, which the rig's oracle reports.
"""

from __future__ import annotations

from pathlib import Path

from support.engine_rig import EngineRig

CHUNK = 32


def _image(offset: int, length: int) -> list:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(offset, length))]


def test_image_added_later_is_never_served_to_text(tmp_path: Path) -> None:
    rig = EngineRig(tmp_path, encoder_budget=4096)
    try:
        session = rig.add("session", list(range(4, 204)), resumable=True)
        rig.run()
        saved_text = rig.counters["committed_chunks"]
        assert saved_text == 200 // CHUNK  # text tokens: cacheable
        # the next input brings an image at positions 200-263; its placeholder ids are 9s
        rig.add(
            "session", [9] * 64 + list(range(300, 400)), resumable=True, mm_features=_image(0, 64)
        )
        rig.run()
        assert session.num_computed_tokens > 300
        # the chunks over and after the image are saved too, keyed by the image
        assert rig.counters["committed_chunks"] > saved_text
        rig.settle()
        rig.abort("session")  # the session ends; drop its blocks from vLLM's own cache
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
        text = rig.add("text", list(session.all_token_ids)[:-1])  # the same ids, no image
        reports = rig.run()
        # only the chunks before the image are the text's (the 6th overlaps the image)
        assert next(r.starts["text"] for r in reports if "text" in r.starts) == 6 * CHUNK
        assert rig.wrong == []
        assert text.output_token_ids
    finally:
        rig.close()


def test_text_session_saves_what_it_computed_and_a_fresh_request_hits_it(tmp_path: Path) -> None:
    """Continuing a text session drops the last sampled token (never computed) and appends
    the new input: chunks are keyed by the tokens the KV was computed from."""
    rig = EngineRig(tmp_path)
    try:
        session = rig.add("session", list(range(4, 131)), resumable=True)  # 127 tokens
        rig.run()
        rig.add("session", list(range(200, 300)), resumable=True)
        rig.run()
        assert session.all_token_ids[127] == 200  # the sampled token is gone
        rig.settle()
        rig.abort("session")  # the session ends; drop its blocks from vLLM's own cache
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
        tokens = list(session.all_token_ids)[:-1]
        fresh = rig.add("fresh", tokens)
        reports = rig.run()
        start = next(r.starts["fresh"] for r in reports if "fresh" in r.starts)
        assert start == (len(tokens) - 1) // CHUNK * CHUNK  # every whole chunk but the last token's
        assert rig.wrong == []
        assert fresh.output_token_ids
    finally:
        rig.close()
