"""Where vLLM cannot compute exactly over a cached prefix, kvtier serves no hits.

vLLM turns its own prefix caching off for such models (MLA on CPU: with it forced on, vLLM's
own hits differ from a recompute there). kvtier follows: no lookups answered, nothing saved,
and a start-up warning that says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.connector.layout import prefix_reuse_refused
from kvtier.testing.models import make_tiny_deepseek_v2

from support.engine_rig import EngineRig


def test_mla_on_cpu_is_refused_with_the_reason(tmp_path: Path) -> None:
    """A tiny DeepSeek-V2 (MLA) as vLLM's CPU build configures it."""
    from vllm.config import ModelConfig, VllmConfig

    model = make_tiny_deepseek_v2(tmp_path / "dsv2")
    config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32"))
    assert config.model_config.use_mla
    reason = prefix_reuse_refused(config)
    assert reason is not None and "MLA" in reason


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
