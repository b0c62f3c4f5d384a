"""What the scheduler side keeps per request (``RequestState``) and what a lookup found for it
(``LookupOutcome``), with the leases it holds.

A request's inputs can change while it lives (vLLM's streaming-input sessions append prompt
tokens, drop the last sampled token, and may add an image later), so ``refresh()`` runs at
every hook: it re-evaluates cacheability and drops the keys of chunks whose tokens are not
computed yet. A ``LookupOutcome`` remembers, per TP rank, which store incarnation (epoch) its
extents belong to: a store that restarts between the lookup and the load has another pool,
and the load fails instead of copying the old pool's offsets out of the new one.

Threading: a ``RequestState``'s keyers are guarded by its lock (the lookup and alloc threads
key chunks too); the rest is the scheduler thread's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.core.chunks import ChunkLocation
from kvtier.core.keys import MediaItem, PromptKeyer, salt_digest

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllm.v1.request import Request


def inputs_of(request: Request) -> tuple[int, int, bool]:
    """What identifies a request's inputs: prompt length, multimodal items, embeddings."""
    return (
        request.num_prompt_tokens,
        len(request.mm_features or ()),
        getattr(request, "prompt_embeds", None) is not None,
    )


def cacheable(request: Request) -> bool:
    """Token ids and multimodal items' identities determine the KV (not prompt embeddings)."""
    return request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None


def media_of(request: Request) -> tuple[MediaItem, ...]:
    """The request's multimodal items, as chunk keys name them (``core/keys.py``): a chunk
    overlapping an item's placeholders is keyed by the item too, as vLLM's own prefix cache
    keys its blocks, so two images at the same placeholder positions never share KV."""
    return tuple(
        MediaItem(f.mm_position.offset, f.mm_position.length, str(f.identifier))
        for f in request.mm_features or ()
    )


@dataclass
class LookupOutcome:
    """What the tiers hold past ``computed`` tokens (vLLM's own hit) for one request."""

    computed: int  # vLLM's local hit this outcome was computed for
    first_chunk: int  # chunk holding token ``computed``
    hits: dict[int, list[ChunkLocation]] = field(default_factory=dict)  # per rank, leased
    epochs: dict[int, int] = field(default_factory=dict)  # per rank: incarnation of the hits
    lease_ids: list[int] = field(default_factory=list)  # every lease taken (all ranks, tiers)
    leased_at: float = field(default_factory=time.monotonic)
    tokens: int = 0  # tokens vLLM may skip (0 when the run is not worth a load)
    sources: dict[str, int] = field(default_factory=dict)  # tier name -> tokens of ``tokens``
    consumed: bool = False  # turned into a LoadJob
    released: bool = False
    lease_lost: bool = False  # a renewal found a lease gone: never load from it
    session_generation: int = 0  # the store session the leases were taken under
    lease_ttl_s: float = 0.0  # the shortest TTL the store granted its leases (0: none yet)

    def granted(self, lease_ttl_s: float) -> None:
        """Record a lease's granted TTL: the store may cap what was asked without an error."""
        if lease_ttl_s > 0:
            self.lease_ttl_s = min(self.lease_ttl_s or lease_ttl_s, lease_ttl_s)


@dataclass
class RequestState:
    request: Request
    salt: str  # salt_digest(request.cache_salt)
    lora_path: str  # the adapter's files ('' for the base model)
    inputs: tuple[int, int, bool]
    cacheable: bool
    generation: int  # the namespace generation ns_ids were resolved for
    ns_ids: dict[int, bytes] | None = None  # per TP rank, set by the first lookup or save
    # per TP rank: the sibling namespace of chunks stored without state (``has_state``)
    attention_ns_ids: dict[int, bytes] | None = None
    keyers: dict[int, PromptKeyer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    lookup: Future[LookupOutcome] | None = None
    lookup_for: int = -1  # vLLM's local hit the lookup in flight (or last done) is for
    lookup_deadline: float = 0.0
    lookup_waited: bool = False  # a step waited for the lookup in flight once: no step again
    gave_up_for: int = -1  # a lookup for this local hit ran past its deadline: answer 0
    outcome: LookupOutcome | None = None
    save_from_chunk: int = 0  # chunks before this were hits, not computed here
    saved_upto: int = 0  # chunks [save_from_chunk, saved_upto) already planned for saving
    load_tokens: int = 0  # external tokens of the load in flight
    no_external: bool = False  # a load failed: this request recomputes from here on
    # Tokens [from, upto) whose device blocks a load failed to fill (and everything computed
    # over them): never saved unless a step of this request recomputes them. vLLM rewinds the
    # request to recompute, but a preempted request can resume on a device hit over them.
    unfilled: tuple[int, int] | None = None

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
                self.ns_ids = self.attention_ns_ids = None
                self.keyers = {}
            changed = True
        return changed

    def recomputes(self, computed: int, count: int, chunk_tokens: int) -> None:
        """A step of ``count`` tokens from ``computed``: follow the recompute of unfilled
        tokens; a step that starts past them (they were skipped, not recomputed) moves the
        first savable chunk past its start."""
        if self.unfilled is None:
            return
        start, upto = self.unfilled
        if computed > start:
            first_clean = -(-computed // chunk_tokens)
            self.save_from_chunk = max(self.save_from_chunk, first_clean)
            self.saved_upto = max(self.saved_upto, first_clean)
            self.unfilled = None
        elif computed + count >= upto:
            self.unfilled = None
        else:
            self.unfilled = (max(start, computed + count), upto)

    def keys(self, rank: int, upto_chunks: int, chunk_tokens: int) -> list[bytes]:
        """Keys of the first ``upto_chunks`` chunks of the request's tokens (so far)."""
        with self.lock:
            keyer = self.keyers[rank]
            if len(keyer.keys) < upto_chunks:
                tokens: Any = self.request.all_token_ids
                keyer.extend(tokens[: upto_chunks * chunk_tokens], media_of(self.request))
            return keyer.keys[:upto_chunks]


def take_leases(outcome: LookupOutcome) -> list[int]:
    """Mark the outcome released and return the lease ids to give back (once; [] after)."""
    if outcome.released:
        return []
    outcome.released = True
    return list(outcome.lease_ids)
