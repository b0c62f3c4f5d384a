"""MLA on vLLM's CPU build: kvtier serves no hits for it and says why at start-up. Without
AMX vLLM turns its own prefix caching off for MLA (its cached-prefix path is not exact
there); with AMX (an Intel Xeon host) it keeps it on for its AMX MLA backend, whose hits
have not been shown exact here either: refused on both. An integration test because vLLM
inspects a DeepSeek architecture in a subprocess."""

from __future__ import annotations

from pathlib import Path

from kvtier.connector.model_support import prefix_reuse_refused
from kvtier.testing.models import make_tiny_deepseek_v2


def test_mla_on_cpu_is_refused_with_the_reason(tmp_path: Path) -> None:
    """A tiny DeepSeek-V2 (MLA) as vLLM's CPU build configures it."""
    from vllm.config import ModelConfig, VllmConfig

    model = make_tiny_deepseek_v2(tmp_path / "dsv2")
    config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32"))
    assert config.model_config.use_mla
    reason = prefix_reuse_refused(config)
    assert reason is not None and "MLA" in reason
