"""Where vLLM cannot compute exactly over a cached prefix, kvtier serves no hits.

vLLM turns its own prefix caching off for such models (MLA on CPU: with it forced on, vLLM's
own hits differ from a recompute there). kvtier follows: no lookups answered, nothing saved,
and a start-up warning that says why (MLA on CPU itself: tests/integration/test_mla_refusal.py,
since vLLM inspects a DeepSeek model in a subprocess).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from support.engine_rig import EngineRig


def test_no_hits_and_no_saves_where_vllm_prefix_caching_is_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        rig = EngineRig(tmp_path, prefix_caching=False)
    try:
        assert "serves no hits" in caplog.text
        prompt = list(range(100, 260))
        rig.add("first", prompt)
        rig.run()
        rig.settle()
        rig.add("again", prompt)
        reports = rig.run()
        assert next(r.starts["again"] for r in reports if "again" in r.starts) == 0
        assert rig.counters.get("committed_chunks", 0) == 0
        assert rig.counters.get("cpu_hit_tokens", 0) == 0
        assert rig.wrong == []
    finally:
        rig.close()


def test_the_same_engine_with_prefix_caching_on_does_hit(tmp_path: Path) -> None:
    """The control: the refusal above is the rule's doing, not the rig's."""
    rig = EngineRig(tmp_path)
    try:
        prompt = list(range(100, 260))
        rig.add("first", prompt)
        rig.run()
        rig.settle()
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()
        rig.add("again", prompt)
        reports = rig.run()
        assert (
            next(r.starts["again"] for r in reports if "again" in r.starts) == 144
        )  # all but the last block
        assert rig.wrong == []
    finally:
        rig.close()
