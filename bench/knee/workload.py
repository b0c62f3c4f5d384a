"""The capacity-knee workload: S sessions x T turns with a cumulative prefix, as a session trace.

Turn t of a session sends the session's previous prompt, the previous answer (O tokens) and a
new user message (U tokens), so its prompt has L_t = t*U + (t-1)*O tokens, and asks for O
tokens. A session's working set is W = L_T + O (its KV at the end of its last turn); S sessions
need S*W.

The answer resent in the next turn is the generator's stand-in, not what the model said: token
ids are then a function of (seed, session, position) alone, identical in every configuration of
a sweep (a greedy answer can change with the batch it ran in). So each turn's O answer tokens
miss like the user message does; ``ideal_hit_ratio`` (what an infinite cache would hit) counts
that.

A session is one stream of blocks with hash ids ((session + 1) << 32) + position, its own: no
block is shared across sessions. The workload is thus a session-format trace
(``docs/traces.md``, ``write_trace``; ``kvtier trace analyze`` reads it), its tokens come from
the trace tools' ``PromptBuilder`` and its items go to their ``Replayer``. U and O are whole
blocks, so every prompt ends on a block boundary and the hash ids say exactly what a prefix
cache can hit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.traces.formats import TraceFormat, TraceRequest, TraceWriter
from kvtier.traces.prompts import PromptBuilder, PromptSpec
from kvtier.traces.replay import ReplayItem


def _bad(message: str) -> KvtierError:
    return KvtierError(ErrorCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Workload:
    sessions: int = 4
    turns: int = 6
    user_tokens: int = 224  # U: the new user message of each turn
    output_tokens: int = 32  # O: asked for, and the stand-in answer resent next turn
    block_tokens: int = 32  # vLLM's block size
    vocab_size: int = 512
    token_offset: int = 4  # ids below are special tokens, never sent
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "user_tokens", "output_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise _bad(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("user_tokens", "output_tokens"):
            if getattr(self, name) % self.block_tokens:
                raise _bad(
                    f"{name}={getattr(self, name)} must be a multiple of the block size "
                    f"({self.block_tokens}): every prompt then ends on a block boundary and "
                    "the hash ids say exactly what a prefix cache can hit"
                )
        self.prompt_spec()  # validates the vocabulary

    def prompt_spec(self) -> PromptSpec:
        bt = self.block_tokens
        return PromptSpec(bt, bt, self.vocab_size, self.token_offset, self.seed)

    def prompt_length(self, turn: int) -> int:
        """L_t; 0 for turn 0 (before the first)."""
        return turn * self.user_tokens + max(turn - 1, 0) * self.output_tokens

    @property
    def working_set_tokens(self) -> int:
        """W: a session's KV at the end of its last turn (its last prompt and answer)."""
        return self.prompt_length(self.turns) + self.output_tokens

    @property
    def total_working_set_tokens(self) -> int:
        return self.sessions * self.working_set_tokens

    @property
    def max_model_len(self) -> int:
        return self.working_set_tokens

    def ideal_cached_tokens(self, turn: int) -> int:
        """What an infinite prefix cache hits: the session's previous prompt, whole blocks."""
        return self.prompt_length(turn - 1)

    @property
    def prompt_tokens(self) -> int:
        return self.sessions * sum(self.prompt_length(t) for t in range(1, self.turns + 1))

    @property
    def ideal_hit_ratio(self) -> float:
        hits = self.sessions * sum(self.ideal_cached_tokens(t) for t in range(1, self.turns + 1))
        return hits / self.prompt_tokens

    def hash_ids(self, session: int, turn: int) -> list[int]:
        base = (session + 1) << 32  # a session's blocks are its own: no cross-session sharing
        return [base + i for i in range(self.prompt_length(turn) // self.block_tokens)]

    def requests(self) -> Iterator[TraceRequest]:
        """The workload as a session-format trace, turn by turn (timestamps: turn - 1 in s)."""
        for turn in range(1, self.turns + 1):
            for session in range(self.sessions):
                yield TraceRequest(
                    timestamp=(turn - 1) * 1000,
                    input_length=self.prompt_length(turn),
                    output_length=self.output_tokens,
                    hash_ids=self.hash_ids(session, turn),
                    session_id=f"s{session}",
                    turn=turn,
                )

    def write_trace(self, path: Path) -> Path:
        with TraceWriter(path, TraceFormat.SESSION) as writer:
            for req in self.requests():
                writer.write(req)
        return path

    def items(self) -> list[ReplayItem]:
        builder = PromptBuilder(self.prompt_spec())
        return [
            ReplayItem(
                index=i,
                scheduled_s=0.0,
                max_tokens=self.output_tokens,
                make_tokens=functools.partial(builder.request_tokens, req),
                session=req.session_id or "",
                turn=req.turn or 1,
                cls=f"turn {req.turn}",
                expected_cached_tokens=self.ideal_cached_tokens(req.turn or 1),
            )
            for i, req in enumerate(self.requests())
        ]

    def warmup_items(self, count: int = 2) -> list[ReplayItem]:
        """One prompt (sent ``count`` times: a miss, then hits) no workload prompt shares a
        block with (negative hash ids), so warming up leaves nothing the workload could hit."""
        builder = PromptBuilder(self.prompt_spec())
        length = self.prompt_length(min(2, self.turns))
        ids = [-(i + 1) for i in range(length // self.block_tokens)]
        return [
            ReplayItem(
                index=-(k + 1),
                scheduled_s=0.0,
                max_tokens=self.output_tokens,
                make_tokens=lambda: builder.tokens(ids, length),
                session="warm-up",
                turn=k + 1,
                cls="warm-up",
                warmup=True,
            )
            for k in range(count)
        ]

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "prompt_tokens_by_turn": [self.prompt_length(t) for t in range(1, self.turns + 1)],
            "working_set_tokens": self.working_set_tokens,
            "total_working_set_tokens": self.total_working_set_tokens,
            "prompt_tokens": self.prompt_tokens,
            "ideal_hit_ratio": self.ideal_hit_ratio,
        }
