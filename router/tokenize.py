"""Token ids of a request, computed once, as vLLM computes them.

The router needs ids to ask the index who holds the prompt (chunk keys are over token ids).
With the model's tokenizer at hand (``router.model``) it tokenizes in process with HF
``tokenizers`` and, for ``/v1/completions``, forwards the ids as the prompt so vLLM does not
tokenize again; without it, it asks an instance's ``/tokenize`` (an extra round trip, measured
by ``kvtier bench router``).

As vLLM does (0.32, ``vllm/entrypoints/openai``): a completion's text prompt is encoded with
special tokens (``add_special_tokens`` defaults to true); a chat is rendered with the model's
chat template (``add_generation_prompt`` true unless the request says otherwise,
``continue_final_message``, ``chat_template_kwargs``, ``tools``), text content parts joined
with newlines, and the rendering encoded without special tokens. tests/engine/test_router_vllm.py
checks the ids equal vLLM's ``/tokenize`` for both.

Long conversations: a session's rendering grows turn by turn. ``SessionCache`` keeps the last
rendering and ids per session and re-encodes only from a token boundary ``BACKOFF_CHARS``
before the old end, so a 100k-token conversation costs one turn's tokens, not 100k. (Chat ids
only steer routing; completions are always encoded whole, since those ids are the prompt.)

Routing by the last turn (``last_turn_ids``): even one turn's encoding, plus rendering the
template over the whole conversation, costs milliseconds, more than the rest of a decision.
A turn whose messages start with the session's last tokenized turn (same template arguments)
is routed by that turn's ids, and its length estimated from the new messages' characters at
the session's own characters per token; the proxy tokenizes the new turn after routing, off
the request's path, for the next turn. What that can cost is a mis-scored route, never a
wrong token (the instance tokenizes the request itself): the new turn's chunks are almost
never held anywhere, and the load estimate is off by the estimate's error.

Threading: thread-safe (the HF tokenizer is; the session cache has a lock).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BACKOFF_CHARS = 64


@dataclass
class _Session:
    text: str
    ids: list[int]
    ends: list[int]  # character end offset of each token
    messages: list[Any] | None = None  # the turn's messages as sent (``last_turn_ids``)
    template: str = ""  # its template arguments, as JSON
    chars: int = 0  # characters of content in ``messages``


class SessionCache:
    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_tokens = 0  # tokens not re-encoded thanks to the cache

    def get(self, session: str) -> _Session | None:
        with self._lock:
            entry = self._sessions.get(session)
            if entry is not None:
                self._sessions.move_to_end(session)
            return entry

    def put(self, session: str, entry: _Session) -> None:
        with self._lock:
            self._sessions[session] = entry
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


def _text_content(content: Any) -> Any:
    """OpenAI content parts -> the string vLLM renders for a text model."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _template_args(body: dict[str, Any]) -> str:
    """What besides the messages shapes the rendering (compared between turns)."""
    fields = ("chat_template_kwargs", "tools", "add_generation_prompt", "continue_final_message")
    return json.dumps([body.get(f) for f in fields], sort_keys=True, default=str)


def _content_chars(messages: Sequence[Any]) -> int:
    total = 0
    for m in messages:
        content = _text_content(m.get("content")) if isinstance(m, dict) else None
        total += len(content) if isinstance(content, str) else 0
    return total


class PromptTokenizer:
    """In-process tokenization with the model's own tokenizer (``transformers``)."""

    def __init__(self, model: str, max_sessions: int = 4096) -> None:
        from transformers import AutoTokenizer

        self._tokenizer: Any = AutoTokenizer.from_pretrained(model)
        # the Rust tokenizer under a fast one: the same ids and offsets without transformers'
        # per-call wrapping (~0.25 ms of a 1k-token turn's ~1 ms, kvtier bench router)
        self._backend: Any = getattr(self._tokenizer, "backend_tokenizer", None)
        self.sessions = SessionCache(max_sessions)

    def completion_ids(self, prompt: str) -> list[int]:
        return list(self._tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def render_chat(self, body: dict[str, Any]) -> str:
        messages = [
            {**m, "content": _text_content(m.get("content"))} if isinstance(m, dict) else m
            for m in body["messages"]
        ]
        kwargs = dict(body.get("chat_template_kwargs") or {})
        text = self._tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tools=body.get("tools"),
            **kwargs,
        )
        return str(text)

    def chat_ids(self, body: dict[str, Any], session: str | None = None) -> list[int]:
        text = self.render_chat(body)
        if session is None:
            return self._encode(text).ids
        cached = self.sessions.get(session)
        entry = self._extend(cached, text) if cached is not None else None
        if entry is None:
            entry = self._encode(text)
        entry.messages = list(body["messages"])
        entry.template = _template_args(body)
        entry.chars = _content_chars(entry.messages)
        latest = self.sessions.get(session)
        if latest is None or len(latest.messages or ()) <= len(entry.messages):
            self.sessions.put(session, entry)  # never replaced by an older turn finishing late
        return entry.ids

    def last_turn_ids(self, body: dict[str, Any], session: str) -> tuple[list[int], int] | None:
        """(the session's last tokenized turn's ids, this turn's estimated length) when this
        turn extends that one, else None (see the module docstring). No rendering, no encoding:
        a comparison of the message lists."""
        cached = self.sessions.get(session)
        messages = body.get("messages")
        if cached is None or cached.messages is None or not isinstance(messages, list):
            return None
        old = cached.messages
        if len(messages) < len(old) or messages[: len(old)] != old or not cached.ids:
            return None
        if _template_args(body) != cached.template:
            return None
        added = _content_chars(messages[len(old) :])
        per_token = cached.chars / len(cached.ids) if cached.chars else 4.0
        return cached.ids, len(cached.ids) + round(added / max(per_token, 1.0))

    def _encode(self, text: str, base: int = 0) -> _Session:
        if self._backend is not None:
            fast = self._backend.encode(text, add_special_tokens=False)
            return _Session(text, list(fast.ids), [base + end for _, end in fast.offsets])
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return _Session(
            text, list(enc["input_ids"]), [base + end for _, end in enc["offset_mapping"]]
        )

    def _extend(self, old: _Session, text: str) -> _Session | None:
        """Re-encode ``text`` from a token boundary well inside what ``old`` encoded."""
        if not text.startswith(old.text) or not old.ids:
            return None
        limit = len(old.text) - BACKOFF_CHARS
        keep = _tokens_ending_by(old.ends, limit)
        if keep == 0:
            return None
        start = old.ends[keep - 1]
        tail = self._encode(text[start:], base=start)
        self.sessions.reused_tokens += keep
        return _Session(text, old.ids[:keep] + tail.ids, old.ends[:keep] + tail.ends)


def _tokens_ending_by(ends: Sequence[int], limit: int) -> int:
    """How many leading tokens end at or before character ``limit``."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] <= limit:
            lo = mid + 1
        else:
            hi = mid
    return lo
