"""The trace-replay tests' vLLM: a tiny random Llama behind a real OpenAI server."""

from __future__ import annotations

from pathlib import Path

from kvtier.testing.models import make_tiny_llama
from kvtier.testing.ports import free_port
from kvtier.testing.vllm_server import MODEL_NAME, VllmServer

VOCAB_SIZE = 512
SPECIAL_TOKENS = 4  # <unk> <s> </s> <pad>
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048


def build_tiny_model(out_dir: Path) -> Path:
    return make_tiny_llama(out_dir, vocab_size=VOCAB_SIZE, max_positions=MAX_MODEL_LEN)


__all__ = ["MODEL_NAME", "VllmServer", "build_tiny_model", "free_port"]
