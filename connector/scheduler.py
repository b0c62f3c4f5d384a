"""The scheduler side of the connector: resolves each prompt tier-first, owns every lease.

Per request:
1. ``lookup``: the prompt's chunk keys past vLLM's own (GPU) hit are looked up in the node
   store, leased for the load (async when the store is remote: vLLM is told "ask again"
   rather than the scheduler being blocked); runs shorter than the tier's minimum are dropped.
2. ``on_alloc``: the run becomes a ``LoadJob`` over the request's block ids.
3. ``build_meta``: chunks that this step completes become ``SaveJob``s (pool pages allocated
   now, committed when the workers report the bytes are in).
4. ``on_worker_output``: commits finished saves, releases leases of finished loads.

Per-step work is proportional to the requests scheduled and the chunks they touch, never to
what the pool holds. Threading: vLLM calls everything from its scheduler thread; store
lookups may run on ``kvtier-lookup`` threads, commits/releases on one ``kvtier-ops`` thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.config import ConnectorConfig
from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.metadata import (
    ChunkCopy,
    KvtierMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    SaveJob,
    SegmentRef,
)
from kvtier.connector.remote import RemoteResolver
from kvtier.errors import KvtierError
from kvtier.keys import PromptKeyer
from kvtier.store.types import AllocStatus
from kvtier.tiers.base import ChunkLocation
from kvtier.tiers.cpu.tier import CpuTier

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class LookupOutcome:
    """What the tiers hold past ``computed`` tokens (vLLM's own hit) for one request."""

    computed: int  # vLLM's local hit this outcome was computed for
    first_chunk: int  # chunk holding token ``computed``
    hits: dict[int, list[ChunkLocation]]  # per TP rank, the leased run from first_chunk
    lease_ids: list[int]  # every lease taken for this outcome (all ranks, all tiers)
    leased_at: float
    tokens: int = 0  # tokens vLLM may skip (0 when the run is not worth a load)
    cpu_tokens: int = 0  # of which the node store held before the lookup (the rest: remote)
    consumed: bool = False  # turned into a LoadJob
    released: bool = False


@dataclass
class RequestState:
    request: Request
    ns_ids: dict[int, bytes]  # per TP rank
    keyers: dict[int, PromptKeyer]
    cacheable: bool
    lookup: Future[LookupOutcome] | None = None
    lookup_for: int = -1
    outcome: LookupOutcome | None = None
    save_from_chunk: int = 0  # chunks before this were hits, not computed here
    saved_upto: int = 0  # chunks [save_from_chunk, saved_upto) already handed to a save
    load_tokens: int = 0  # external tokens of the load in flight
    no_external: bool = False  # a load failed: this request recomputes from here on


@dataclass
class PendingSave:
    job: SaveJob
    leases: dict[int, int]  # per TP rank: write lease
    keys: dict[int, list[bytes]]
    done_ranks: set[int] = field(default_factory=set)


class ConnectorScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        geometry: KvGeometry,
        identity: ModelIdentity,
        tier: CpuTier,
        embedded: bool,
        remote: RemoteResolver | None = None,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.identity = identity
        self.tier = tier
        self.remote = remote  # None: no remote tier
        if remote is not None:
            remote.bind_stats(self._count)
        self.tp_size = identity.tp_size
        # An embedded store answers in microseconds; remote pulls take a network round trip.
        self._inline_lookups = embedded and remote is None
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup")
        self._ops = ThreadPoolExecutor(1, thread_name_prefix="kvtier-ops")  # FIFO
        self._requests: dict[str, RequestState] = {}
        self._namespaces: dict[tuple[str, str, int], bytes] = {}
        self._pending_loads: list[LoadJob] = []
        self._saves: dict[int, PendingSave] = {}
        self._job_ids = itertools.count(1)
        self.stats: dict[str, float] = {}
        self.hit_sources: dict[str, dict[str, int]] = {}  # req -> tier -> tokens (last plan)
        # req id -> its block ids (vLLM's KV cache manager; bound once the scheduler exists)
        self.block_ids_of: Callable[[str], list[int]] | None = None
        # leases of loads whose request finished while the workers were still copying
        self._release_after_load: dict[str, LookupOutcome] = {}
        self._loading: dict[str, LookupOutcome] = {}  # loads handed to the workers

    # -- namespaces --------------------------------------------------------------------------

    def _ns_ids(self, cache_salt: str, lora: str) -> dict[int, bytes]:
        out = {}
        for rank in range(self.tp_size):
            key = (cache_salt, lora, rank)
            ns_id = self._namespaces.get(key)
            if ns_id is None:
                ns = self.identity.namespace(self.geometry, rank, cache_salt, lora)
                ns_id = self.tier.register_namespace(ns, self.geometry.chunk_bytes)
                self._namespaces[key] = ns_id
            out[rank] = ns_id
        return out

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            lora = request.lora_request.lora_name if request.lora_request else ""
            ns_ids = self._ns_ids(request.cache_salt or "", lora)
            # Token ids alone do not determine KV for multimodal or embedding inputs.
            cacheable = (
                request.prompt_token_ids is not None
                and not request.mm_features
                and getattr(request, "prompt_embeds", None) is None
            )
            keyers = {
                r: PromptKeyer(ns_id, self.geometry.chunk_tokens) for r, ns_id in ns_ids.items()
            }
            state = RequestState(request, ns_ids, keyers, cacheable)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: RequestState, rank: int, upto_chunks: int) -> list[bytes]:
        keyer = state.keyers[rank]
        if len(keyer.keys) < upto_chunks:
            tokens = state.request.all_token_ids
            keyer.extend(tokens[: upto_chunks * self.geometry.chunk_tokens])
        return keyer.keys[:upto_chunks]

    # -- 1. lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, computed: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if not state.cacheable or state.no_external or request.skip_reading_prefix_cache:
            return 0, False
        if state.outcome is not None and (state.outcome.consumed or self._stale(state.outcome)):
            # Used already (vLLM rewound the request, e.g. after a failed load), or waited long
            # in the queue: look up, and lease, afresh.
            self._drop_outcome(state)
        if state.outcome is None or state.outcome.computed != computed:
            if state.lookup is None or state.lookup_for != computed:
                self._drop_outcome(state)
                state.lookup_for = computed
                if self._inline_lookups:
                    state.lookup = _done(self._lookup, state, computed)
                else:
                    state.lookup = self._lookups.submit(self._lookup, state, computed)
            try:
                state.outcome = state.lookup.result(timeout=self.config.lookup_wait_ms / 1e3)
            except FutureTimeout:
                self._count("lookups_pending")
                return None, False  # vLLM asks again next step; the scheduler never blocks
            except Exception as exc:
                log.warning("kvtier lookup failed for %s: %r", request.request_id, exc)
                self._count("lookup_errors")
                state.outcome = LookupOutcome(
                    computed, computed // self.geometry.chunk_tokens, {}, [], time.monotonic()
                )
            state.lookup = None
        tokens = state.outcome.tokens
        return tokens, tokens > 0 and self.config.load_mode == "async"

    def _lookup(self, state: RequestState, computed: int) -> LookupOutcome:
        """Tier-first lookup for every TP rank: the node store's run (leased), then the run
        after it pulled from another node's store into this one (leased too). Runs on a lookup
        thread unless the store is embedded and there is no remote tier."""
        geo = self.geometry
        request = state.request
        first = computed // geo.chunk_tokens
        total_chunks = request.num_tokens // geo.chunk_tokens
        outcome = LookupOutcome(computed, first, {}, [], time.monotonic())
        if total_chunks <= first:
            return outcome
        keys = {rank: self._keys(state, rank, total_chunks)[first:] for rank in state.ns_ids}
        local = 0
        if "cpu" in self.config.tiers:
            for rank, ns_id in state.ns_ids.items():
                result = self.tier.call("lookup", ns_id, keys[rank], self.config.lease_ttl_s)
                outcome.hits[rank] = result.hits
                if result.lease_id:
                    outcome.lease_ids.append(result.lease_id)
            local = min(len(h) for h in outcome.hits.values())
        remote = self._pull_remote(state, keys, local, outcome) if self.remote else 0
        # Leave vLLM the prompt's last block to compute, as its own prefix cache does: a sync
        # load must leave it a token anyway, and an async full hit would have vLLM recompute
        # the last token alone, which rounds differently from computing the block (same math,
        # other kernel tiling) - then a hit would not give exactly a recompute's logprobs.
        cap = (request.num_tokens - 1) // geo.block_size * geo.block_size
        end = min((first + local + remote) * geo.chunk_tokens, cap)
        tokens = max(0, end - computed)
        outcome.cpu_tokens = max(0, min(end, (first + local) * geo.chunk_tokens) - computed)
        self._count("lookups")
        self._count("lookup_tokens", request.num_tokens - computed)
        if tokens and tokens < self.config.min_hit_tokens.get("cpu", 0):
            self._count("cpu_skipped_tokens", tokens)
            tokens = outcome.cpu_tokens = 0
        outcome.tokens = tokens
        if not tokens:
            self._release(outcome)
        return outcome

    def _pull_remote(
        self, state: RequestState, keys: dict[int, list[bytes]], local: int, outcome: LookupOutcome
    ) -> int:
        """Pull the run after the local one from another node (every rank), lease it here.
        Returns the chunks added to ``outcome`` (0 when none, or not worth a round trip)."""
        assert self.remote is not None
        if local >= min(len(k) for k in keys.values()):
            return 0
        min_chunks = -(-self.config.min_hit_tokens.get("remote", 0) // self.geometry.chunk_tokens)
        pulled = []
        for rank, ns_id in state.ns_ids.items():
            run = self.remote.pull(ns_id, keys[rank][local:], max(1, min_chunks))
            pulled.append(run.chunks if run is not None else 0)
            if not pulled[-1]:
                return 0  # every rank needs the run
        n = min(pulled)
        for rank, ns_id in state.ns_ids.items():
            result = self.tier.call(
                "lookup", ns_id, keys[rank][local : local + n], self.config.lease_ttl_s
            )
            if result.lease_id:
                outcome.lease_ids.append(result.lease_id)
            outcome.hits[rank] = outcome.hits.get(rank, [])[:local] + result.hits
            n = min(n, len(result.hits))  # evicted here already: keep what is leased
        self._count("remote_pulled_chunks", n)
        return n

    def _drop_outcome(self, state: RequestState) -> None:
        if state.outcome is not None and not state.outcome.consumed:
            self._release(state.outcome)
        state.outcome = None

    # -- 2. after vLLM allocated blocks ------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        outcome = state.outcome
        if num_external_tokens == 0:
            if outcome is not None and not outcome.consumed:
                # Not loading after all (or the 2nd call of an async load): keep the chunk
                # boundary for saving and let the leases go.
                state.save_from_chunk = outcome.computed // self.geometry.chunk_tokens
                self._release(outcome)
                outcome.consumed = True
            return
        geo = self.geometry
        info = self.tier.info
        job = LoadJob(
            req_id=request.request_id,
            segment=SegmentRef(info.segment_name, info.segment_size, info.epoch),
            chunks={},
            is_async=self.config.load_mode == "async",
            verify=self.config.verify_loads,
        )
        self._pending_loads.append(job)
        if outcome is None or outcome.consumed or outcome.tokens < num_external_tokens:
            # vLLM allocated for a load we did not offer (should not happen). It will use the
            # blocks as loaded, so fail them: vLLM recomputes, nothing wrong is served.
            log.error(
                "kvtier: %s allocated %d external tokens without a matching lookup",
                request.request_id,
                num_external_tokens,
            )
            first = request.num_computed_tokens // geo.block_size
            job.failed = True
            job.error_block_ids = tuple(
                block_ids[first : first + num_external_tokens // geo.block_size]
            )
            state.no_external = True
            return
        outcome.consumed = True
        first_block = outcome.computed // geo.block_size
        n_blocks = num_external_tokens // geo.block_size
        for rank, hits in outcome.hits.items():
            copies: list[ChunkCopy] = []
            for b in range(first_block, first_block + n_blocks):
                chunk, pos = divmod(b, geo.blocks_per_chunk)
                loc = hits[chunk - outcome.first_chunk]
                if copies and copies[-1].extents == loc.extents:
                    last = copies[-1]
                    copies[-1] = ChunkCopy(
                        last.extents,
                        last.checksum,
                        last.first_block,
                        (*last.block_ids, block_ids[b]),
                    )
                else:
                    copies.append(ChunkCopy(loc.extents, loc.checksum, pos, (block_ids[b],)))
            job.chunks[rank] = copies
        # A lease near expiry could lapse before the worker copies: never load from it.
        if self._remaining(outcome) < self.config.lease_ttl_s / 4:
            self._count("lease_lapsed_loads")
            job.failed = True
        self._loading[request.request_id] = outcome
        state.load_tokens = num_external_tokens
        state.save_from_chunk = (outcome.computed + num_external_tokens) // geo.chunk_tokens
        state.saved_upto = max(state.saved_upto, state.save_from_chunk)
        cpu = min(outcome.cpu_tokens, num_external_tokens)
        self.hit_sources[request.request_id] = {"cpu": cpu, "remote": num_external_tokens - cpu}
        self._count("cpu_hit_tokens", cpu)
        self._count("remote_hit_tokens", num_external_tokens - cpu)

    # -- 3. per step -------------------------------------------------------------------------

    def build_meta(self, scheduled: list[tuple[str, int, int]]) -> KvtierMetadata:
        """``scheduled``: (req id, computed tokens before the step, tokens this step)."""
        meta = KvtierMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._renew_loading()
        if self.config.save != "none":
            meta.saves = self._plan_saves(scheduled)
        return meta

    def _plan_saves(self, scheduled: list[tuple[str, int, int]]) -> list[SaveJob]:
        geo = self.geometry
        wanted: list[tuple[RequestState, int, int]] = []  # state, first chunk, end chunk
        for req_id, computed, count in scheduled:
            state = self._requests.get(req_id)
            if state is None or not state.cacheable:
                continue
            request = state.request
            limit = (
                request.num_prompt_tokens if self.config.save == "prompt" else request.num_tokens
            )
            done = min(computed + count, limit) // geo.chunk_tokens
            start = max(state.save_from_chunk, state.saved_upto)
            if done > start:
                wanted.append((state, start, done))
                state.saved_upto = done
        if not wanted or self.block_ids_of is None:
            return []
        jobs = []
        for state, start, end in wanted:
            job = self._allocate_save(state, start, end)
            if job is not None:
                jobs.append(job)
        return jobs

    def _allocate_save(self, state: RequestState, start: int, end: int) -> SaveJob | None:
        geo = self.geometry
        req_id = state.request.request_id
        block_ids = self.block_ids_of(req_id)
        job_id = next(self._job_ids)
        chunks: dict[int, list[ChunkCopy]] = {}
        leases: dict[int, int] = {}
        keys_by_rank: dict[int, list[bytes]] = {}
        try:
            for rank, ns_id in state.ns_ids.items():
                keys = self._keys(state, rank, end)[start:end]
                result = self.tier.call("allocate", ns_id, keys, [geo.chunk_bytes] * len(keys))
                copies, allocated = [], []
                for i, (status, loc) in enumerate(
                    zip(result.statuses, result.locations, strict=True)
                ):
                    self._count(f"save_{status.value}")
                    if status is not AllocStatus.ALLOCATED or loc is None:
                        continue
                    chunk = start + i
                    ids = tuple(
                        block_ids[chunk * geo.blocks_per_chunk : (chunk + 1) * geo.blocks_per_chunk]
                    )
                    copies.append(ChunkCopy(loc.extents, 0, 0, ids))
                    allocated.append(keys[i])
                if copies:
                    chunks[rank] = copies
                    leases[rank] = result.lease_id
                    keys_by_rank[rank] = allocated
        except KvtierError as exc:
            log.warning("kvtier: cannot allocate pool space for %s: %s", req_id, exc)
            self._count("save_errors")
            for lease_id in leases.values():
                self._ops.submit(self._quiet, "abort", lease_id)
            return None
        if not chunks:
            return None
        info = self.tier.info
        job = SaveJob(
            job_id, req_id, SegmentRef(info.segment_name, info.segment_size, info.epoch), chunks
        )
        self._saves[job_id] = PendingSave(job, leases, keys_by_rank)
        return job

    # -- 4. worker results -------------------------------------------------------------------

    def on_worker_output(self, meta: KvtierWorkerMetadata | None) -> None:
        if meta is None:
            return
        for job_id, ranks in meta.saved.items():
            pending = self._saves.get(job_id)
            if pending is None:
                continue
            pending.done_ranks |= ranks
            if pending.done_ranks >= set(pending.leases):
                del self._saves[job_id]
                for rank, lease_id in pending.leases.items():
                    self._ops.submit(self._commit, lease_id, len(pending.keys[rank]))
        for job_id in meta.save_failed:
            pending = self._saves.pop(job_id, None)
            if pending is not None:
                for lease_id in pending.leases.values():
                    self._ops.submit(self._quiet, "abort", lease_id)
        for req_id in set(meta.loaded) | set(meta.load_failed):
            self._loading.pop(req_id, None)
            state = self._requests.get(req_id)
            if req_id in meta.load_failed:
                self._count("load_failed_requests")
                if state is not None:
                    state.no_external = True  # do not offer the same bytes again
                    self._forget_corrupt(state, meta.corrupt.get(req_id, set()))
            if state is not None:
                state.load_tokens = 0
                if state.outcome is not None:
                    self._release(state.outcome)
            orphan = self._release_after_load.pop(req_id, None)
            if orphan is not None:
                self._release(orphan)

    def _forget_corrupt(self, state: RequestState, ranks: set[int]) -> None:
        """Delete chunks whose bytes failed their checksum, so no one else loads them."""
        outcome = state.outcome
        if outcome is None:
            return
        for rank in ranks:
            keys = [loc.key for loc in outcome.hits.get(rank, [])]
            if keys:
                self._count("corrupt_chunks_deleted", len(keys))
                self._ops.submit(self._quiet, "delete", state.ns_ids[rank], keys)

    def _commit(self, lease_id: int, n: int) -> None:
        try:
            self.tier.call("commit", lease_id, None, [0] * n)
            self._count("committed_chunks", n)
        except KvtierError as exc:
            log.warning("kvtier: commit of %d chunks failed: %s", n, exc)
            self._count("save_errors")

    def _quiet(self, method: str, *args: Any) -> None:
        try:
            self.tier.call(method, *args)
        except KvtierError as exc:
            log.debug("kvtier %s%r: %s", method, args, exc)

    def _remaining(self, outcome: LookupOutcome) -> float:
        return self.config.lease_ttl_s - (time.monotonic() - outcome.leased_at)

    def _stale(self, outcome: LookupOutcome) -> bool:
        return not outcome.consumed and self._remaining(outcome) < self.config.lease_ttl_s / 2

    def _renew_loading(self) -> None:
        """Keep the leases of loads in flight alive however long the steps take."""
        for outcome in self._loading.values():
            if not outcome.released and self._remaining(outcome) < self.config.lease_ttl_s / 2:
                outcome.leased_at = time.monotonic()  # optimistic; a failed renew is logged
                for lease_id in outcome.lease_ids:
                    self._ops.submit(self._quiet, "renew", lease_id, self.config.lease_ttl_s)

    def _release(self, outcome: LookupOutcome) -> None:
        if outcome.released or not outcome.lease_ids:
            outcome.released = True
            return
        outcome.released = True
        self._ops.submit(self._quiet, "release", list(outcome.lease_ids))

    def request_finished(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        self.hit_sources.pop(req_id, None)
        if state is None:
            return
        if state.lookup is not None:
            state.lookup.add_done_callback(lambda f: f.exception() or self._release(f.result()))
        if state.outcome is not None:
            if state.load_tokens:  # workers may still be copying under these leases
                self._release_after_load[req_id] = state.outcome
            else:
                self._release(state.outcome)

    # -- misc --------------------------------------------------------------------------------

    def _count(self, name: str, value: float = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + value

    def take_stats(self) -> dict[str, float]:
        out, self.stats = self.stats, {}
        return out

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self._ops.shutdown(wait=True)


def _done(fn: Any, *args: Any) -> Future:
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future
