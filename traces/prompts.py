"""Token ids for trace requests: the same hash id always becomes the same tokens.

Every hash id maps to ``block_tokens`` token ids drawn from a PCG64 generator seeded with
``(seed, hash id)``, within ``[token_offset, vocab_size)`` so that low special ids (BOS, EOS,
pad) never appear. A request's prompt is its blocks' tokens, the last block cut so the prompt
has the request's input length. Two requests thus share exactly the token prefix their hash ids
share, which is what a prefix cache sees, and replaying the trace again (any process, any
machine) sends the same tokens.

``block_tokens`` may differ from the trace's block (512 for Mooncake) to scale a trace down for
a small model: lengths scale by ``block_tokens / trace_block_tokens``.

Threading: one builder per replay; not thread-safe (it caches recent blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.formats import DEFAULT_BLOCK_TOKENS, TraceRequest

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class PromptSpec:
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per hash id sent to the server
    trace_block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per hash id in the trace
    vocab_size: int = 32000
    token_offset: int = 16  # ids below are never used (special tokens)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.trace_block_tokens <= 0:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "block tokens must be positive")
        if not 0 <= self.token_offset < self.vocab_size:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"token offset {self.token_offset} must be in [0, vocab size {self.vocab_size})",
            )


class PromptBuilder:
    def __init__(self, spec: PromptSpec, cache_blocks: int = 4096) -> None:
        self.spec = spec
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> np.ndarray:
        tokens = self._cache.get(hash_id)
        if tokens is not None:
            self._cache.move_to_end(hash_id)
            return tokens
        h = hash_id & _MASK64
        seq = np.random.SeedSequence([self.spec.seed, h & 0xFFFFFFFF, h >> 32, int(hash_id < 0)])
        rng = np.random.Generator(np.random.PCG64(seq))
        tokens = rng.integers(
            self.spec.token_offset, self.spec.vocab_size, self.spec.block_tokens, dtype=np.int64
        )
        self._cache[hash_id] = tokens
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return tokens

    def prompt_length(self, input_length: int, blocks: int) -> int:
        """The request's input length in sent tokens, inside its last block."""
        if blocks == 0:
            return 0
        bt = self.spec.block_tokens
        scaled = -(-input_length * bt // self.spec.trace_block_tokens)
        return min(max(scaled, (blocks - 1) * bt + 1), blocks * bt)

    def tokens(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        length = self.prompt_length(input_length, len(hash_ids))
        if not length:
            return []
        out = np.concatenate([self.block(h) for h in hash_ids])[:length]
        return out.tolist()

    def request_tokens(self, req: TraceRequest) -> list[int]:
        return self.tokens(req.hash_ids, req.input_length)


@dataclass(frozen=True)
class TokenClass:
    name: str
    below: int | None  # new tokens strictly below this (trace tokens); None = unbounded


DEFAULT_CLASSES = "WARM:5000,MEDIUM:20000,HEAVY"


def parse_classes(text: str) -> list[TokenClass]:
    """``"WARM:5000,MEDIUM:20000,HEAVY"``: ascending bounds, the last class unbounded."""
    out: list[TokenClass] = []
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for i, part in enumerate(parts):
        name, _, bound = part.partition(":")
        if not name:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"class {part!r} has no name")
        last = i == len(parts) - 1
        if last and bound:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "the last class takes no bound")
        if not last:
            try:
                below = int(bound)
            except ValueError:
                raise KvtierError(
                    ErrorCode.INVALID_ARGUMENT, f"class {part!r} needs NAME:BOUND"
                ) from None
            if out and out[-1].below is not None and below <= out[-1].below:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, "class bounds must ascend")
            out.append(TokenClass(name, below))
        else:
            out.append(TokenClass(name, None))
    if not out:
        raise KvtierError(ErrorCode.INVALID_ARGUMENT, "no classes given")
    return out


def classify(classes: Sequence[TokenClass], new_tokens: int) -> str:
    for cls in classes:
        if cls.below is None or new_tokens < cls.below:
            return cls.name
    return classes[-1].name
