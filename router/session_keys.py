"""Chunk keys per session: a conversation's next turn hashes only its own new chunks.

A routing decision keys the whole prompt (SHA-256 over every 256-token chunk, chained: ~1 ms
at 32k tokens, ~4 ms at 128k here) although an agentic session resends the same history each
turn with a little appended. ``SessionKeys`` keeps, per session and namespace, its last
prompt's token ids and the keys of their full chunks; a new prompt that starts with the whole
last prompt reuses those keys and hashes the rest, chained from the last reused key. A prompt
that changed anything earlier (an edited or trimmed history) is keyed whole: a reused key is
always the key of the same tokens, so routing never credits an instance with chunks that
differ from the prompt's.

Bounded by the token ids kept (``max_tokens``, least recently used session first).
Threading: any number of decision threads; one lock around the table (keys are
computed outside it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, prompt_keys


class SessionKeys:
    def __init__(self, max_tokens: int = 1 << 24) -> None:
        """``max_tokens``: tokens of last prompts kept, over every session (16 Mi)."""
        self.max_tokens = max_tokens
        # (session, ns id) -> (its last prompt's token ids, the keys of their full chunks)
        self._last: OrderedDict[tuple[str, bytes], tuple[list[int], list[ChunkKey]]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.reused = 0  # keys taken from a session's last prompt instead of hashed
        self.hashed = 0

    def keys(
        self,
        namespace: Namespace,
        ns_id: bytes,
        token_ids: Sequence[int],
        session: str | None,
    ) -> list[ChunkKey]:
        """Keys of every full chunk of ``token_ids`` in ``namespace`` (as ``prompt_keys``)."""
        if session is None:
            return prompt_keys(namespace, token_ids)
        chunk = namespace.chunk_tokens
        slot = (session, ns_id)
        with self._lock:
            last = self._last.get(slot)
        reuse = 0
        keys: list[ChunkKey] = []
        if last is not None:
            last_ids, last_keys = last
            # the whole last prompt, compared as lists: ids a tokenizer carried over from the
            # last turn are the same objects, so the comparison is mostly pointer checks
            n = len(last_ids)
            if n <= len(token_ids) and list_of(token_ids[:n]) == last_ids:
                reuse, keys = len(last_keys), list(last_keys)
        full = len(token_ids) // chunk * chunk
        parent = keys[-1] if keys else namespace.root_key()
        keys += chunk_keys(parent, token_ids[reuse * chunk : full], chunk, first_chunk=reuse)
        ids = list_of(token_ids)  # kept as is: a decision's ids are not changed after it
        with self._lock:
            self.reused += reuse
            self.hashed += len(keys) - reuse
            old = self._last.pop(slot, None)
            if old is not None:
                self._tokens -= len(old[0])
            self._last[slot] = (ids, keys)
            self._tokens += len(ids)
            while self._tokens > self.max_tokens and self._last:
                _, (dropped, _) = self._last.popitem(last=False)
                self._tokens -= len(dropped)
        return keys


def list_of(token_ids: Sequence[int]) -> list[int]:
    return token_ids if isinstance(token_ids, list) else list(token_ids)
