"""What the scheduler-side connector keeps per request: its namespaces, its chunk keys, how far
it was saved, and whether its inputs still let token ids name its KV.

A request's inputs can change while it lives (vLLM's streaming-input sessions append prompt
tokens, drop the last sampled token, and may add an image later), so ``refresh()`` runs at
every hook: it re-evaluates cacheability and drops the keys of chunks whose tokens are not
computed yet (they may be rewritten). Keys of computed tokens never change.

Threading: a ``RequestState`` is shared by the scheduler thread and at most one lookup thread
at a time; ``lock`` guards its keyers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.keys import PromptKeyer, salt_digest

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllm.v1.request import Request

    from kvtier.connector.resolve import LookupOutcome


def inputs_of(request: Request) -> tuple[int, int, bool]:
    """What identifies a request's inputs: prompt length, multimodal items, embeddings."""
    return (
        request.num_prompt_tokens,
        len(request.mm_features or ()),
        getattr(request, "prompt_embeds", None) is not None,
    )


def cacheable(request: Request) -> bool:
    """Token ids alone determine the KV (no multimodal items, no prompt embeddings)."""
    return (
        request.prompt_token_ids is not None
        and not request.mm_features
        and getattr(request, "prompt_embeds", None) is None
    )


@dataclass
class RequestState:
    request: Request
    salt: str  # salt_digest(request.cache_salt)
    lora_path: str  # the adapter's files ('' for the base model)
    inputs: tuple[int, int, bool]
    cacheable: bool
    generation: int  # the namespace generation ns_ids were resolved for
    ns_ids: dict[int, bytes] | None = None  # per TP rank, set by the first lookup
    keyers: dict[int, PromptKeyer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    lookup: Future[LookupOutcome] | None = None
    lookup_for: int = -1  # vLLM's local hit the lookup in flight (or last done) is for
    lookup_deadline: float = 0.0
    gave_up_for: int = -1  # a lookup for this local hit ran past its deadline: answer 0
    outcome: LookupOutcome | None = None
    save_from_chunk: int = 0  # chunks before this were hits, not computed here
    saved_upto: int = 0  # chunks [save_from_chunk, saved_upto) already planned for saving
    load_tokens: int = 0  # external tokens of the load in flight
    no_external: bool = False  # a load failed: this request recomputes from here on

    @classmethod
    def of(cls, request: Request, generation: int) -> RequestState:
        lora = request.lora_request
        return cls(
            request=request,
            salt=salt_digest(request.cache_salt),
            lora_path=(getattr(lora, "lora_path", "") or "") if lora else "",
            inputs=inputs_of(request),
            cacheable=cacheable(request),
            generation=generation,
        )

    def refresh(self, generation: int, chunk_tokens: int) -> bool:
        """Follow changed inputs or a namespace bump. True when anything was reset (any lookup
        outcome is then stale: the caller drops it)."""
        changed = False
        inputs = inputs_of(self.request)
        if inputs != self.inputs:
            self.inputs = inputs
            self.cacheable = cacheable(self.request)
            stable = self.request.num_computed_tokens // chunk_tokens
            with self.lock:
                for keyer in self.keyers.values():
                    keyer.truncate(stable)
            self.saved_upto = min(self.saved_upto, stable)
            self.save_from_chunk = min(self.save_from_chunk, stable)
            changed = True
        if generation != self.generation:
            self.generation = generation
            with self.lock:
                self.ns_ids = None
                self.keyers = {}
            changed = True
        return changed

    def bind_namespaces(self, ns_ids: dict[int, bytes], chunk_tokens: int) -> None:
        with self.lock:
            if self.ns_ids != ns_ids:
                self.keyers = {r: PromptKeyer(ns, chunk_tokens) for r, ns in ns_ids.items()}
                self.ns_ids = ns_ids

    def keys(self, rank: int, upto_chunks: int, chunk_tokens: int) -> list[bytes]:
        """Keys of the first ``upto_chunks`` chunks of the request's tokens (so far)."""
        with self.lock:
            keyer = self.keyers[rank]
            if len(keyer.keys) < upto_chunks:
                tokens: Any = self.request.all_token_ids
                keyer.extend(tokens[: upto_chunks * chunk_tokens])
            return keyer.keys[:upto_chunks]
