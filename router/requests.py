"""What the router accepts in an OpenAI request body, checked before anything else reads it.

A body that does not fit is answered 400 with a message naming the field, and reaches no
instance: the router keys prompts as uint32 token ids (docs/keys), so an id that is negative,
>= 2**32, a float or a boolean (JSON ``true`` is not a token) would fail deep in the decision
(a 500) or be forwarded for the engine to judge. Shapes, as the OpenAI API and vLLM take them:

- completions ``prompt``: a string, a list of token ids, a list of strings, or a list of
  lists of token ids (a batch: routed by its first prompt), never empty, never mixed;
- chat ``messages``: a non-empty list of objects (their content is the template's to judge);
- ``user`` (names a session when no header does): a string; ``stream``: a boolean.

Parsing a large body holds the GIL for milliseconds per MiB (``json.loads``), so the proxy
parses bodies over ``INLINE_BYTES`` on a worker thread, a few at a time (``PARSE_SLOTS``): the
event loop keeps answering ``/healthz`` and small requests, and the memory a parsed body takes
(~10x its bytes as Python objects) is bounded by a few bodies, not by every connection's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.core import engine_hint

TOKEN_ID_LIMIT = 1 << 32  # ids are uint32 in chunk keys and on the index's wire
INLINE_BYTES = 64 << 10  # bodies up to this are parsed on the event loop (< 1 ms)
PARSE_SLOTS = 2  # larger bodies parsed at once (each on a worker thread)
CHAT_PATH = "/v1/chat/completions"


class BadRequest(ValueError):
    """A body the router refuses (400), with a message for the client."""


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """The request's JSON object, its fields checked (``BadRequest`` otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting too deep
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: a non-empty list is required")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages: each message must be an object")
    else:
        check_prompt(body.get("prompt"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user: a string is required")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream: true or false is required")
    return body


def check_prompt(prompt: Any) -> None:
    """A completion's ``prompt`` has one of the shapes above (``BadRequest`` otherwise)."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(
            "prompt: a string, a list of token ids, a list of strings or a list of lists of "
            "token ids is required (not empty)"
        )
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise BadRequest("prompt: a batch of strings must hold only strings")
    elif isinstance(first, list):
        for i, ids in enumerate(prompt):
            if not isinstance(ids, list) or not ids:
                raise BadRequest(
                    f"prompt[{i}]: a batch of token id lists must hold only non-empty lists"
                )
            check_token_ids(ids, f"prompt[{i}]")
    else:
        check_token_ids(prompt, "prompt")


def check_token_ids(ids: Sequence[Any], where: str) -> list[int]:
    """``ids`` as token ids: integers (not booleans, not floats) in [0, 2**32)."""
    for i, t in enumerate(ids):
        # type() is int, not isinstance: JSON true/false are bools, and bool is an int
        if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT:
            raise BadRequest(
                f"{where}[{i}]: {json.dumps(t)[:40]} is not a token id (an integer in "
                f"0..{TOKEN_ID_LIMIT - 1})"
            )
    return list(ids)


def with_engine_hint(content: bytes, body: dict[str, Any], elsewhere_tokens: int | None) -> bytes:
    """``content`` (the encoded ``body``) carrying the router's word for the instance
    (``kvtier.core.engine_hint``) in ``kv_transfer_params``, replacing any a client wrote
    under that key; ``content`` itself when there is no word and nothing to replace.

    A body without ``kv_transfer_params`` (every client but a disaggregating one) gets the
    field appended to its bytes: no second encoding of a prompt that may be megabytes."""
    params = body.get("kv_transfer_params")
    if elsewhere_tokens is None and not (isinstance(params, dict) and engine_hint.PARAM in params):
        return content
    word = None if elsewhere_tokens is None else engine_hint.hint(elsewhere_tokens)
    end = content.rstrip()
    appendable = "kv_transfer_params" not in body and end.endswith(b"}") and len(body) > 0
    if appendable and word is not None:
        field = json.dumps({"kv_transfer_params": {engine_hint.PARAM: word}})[1:-1]
        return end[:-1] + b", " + field.encode() + b"}"
    merged = dict(params) if isinstance(params, dict) else {}
    merged.pop(engine_hint.PARAM, None)
    if word is not None:
        merged[engine_hint.PARAM] = word
    return json.dumps({**body, "kv_transfer_params": merged}).encode()
