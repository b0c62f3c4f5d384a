"""The scheduler side of the connector: resolves each prompt tier-first, owns every lease.

Per request:
1. ``get_num_new_matched_tokens``: the prompt's chunk keys past vLLM's own (GPU) hit are looked
   up in the node store and leased (``resolve.py``; on a lookup thread unless the store is
   embedded: vLLM is told "ask again" while it runs, "no hit" past ``lookup_deadline_s``).
2. ``update_state_after_alloc``: the run becomes a ``LoadJob`` over the request's block ids,
   naming per TP rank the store incarnation its extents belong to.
3. ``build_meta``: chunks this step completes get pool space (``saves.py``).
4. ``on_worker_output``: failed loads first (their blocks taint every save computed over
   them, leave vLLM's prefix cache, and are never saved until recomputed), then commits of
   the saves whose bytes are good, then lease releases.

Every hook that acts on a request first follows its inputs (``RequestState.refresh``): a
streaming-input session changes them between steps without a new lookup.

Nothing here waits on the network for longer than a small budget per step
(``lookup_waits.py``: the step's budget, one wait per lookup while others run, admission):
store calls run on the ``kvtier-lookup`` / ``kvtier-alloc`` / ``kvtier-ops`` threads (inline
for an embedded store, which answers in microseconds). Per-step work is proportional to the
requests scheduled and the chunks they touch, never to what the pool holds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtier.connector.counters import HIT_TOKENS, C, Counter, Tally
from kvtier.connector.failed_loads import device_blocks_to_evict, forget_corrupt
from kvtier.connector.group_blocks import GroupBlocks, UnfillableBlocks, real_blocks
from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.load_copies import load_copies, tokens_by_tier
from kvtier.connector.lookup import TierResolver
from kvtier.connector.lookup_waits import LookupWaits
from kvtier.connector.metadata import KvtierMetadata, KvtierWorkerMetadata, LoadJob, SegmentRef
from kvtier.connector.request_state import LookupOutcome, RequestState, take_leases
from kvtier.connector.save_slab import SaveSlab, holds_space, slots_target
from kvtier.connector.saves import SavePlanner
from kvtier.core.config.connector import ConnectorConfig
from kvtier.core.errors import KvtierError
from kvtier.tiers import Tiers

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class InlineExecutor(Executor):
    """Runs each call on the caller's thread (an embedded store answers in microseconds)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


@dataclasses.dataclass
class _Loading:
    """A load handed to the workers, until they report it."""

    job: LoadJob
    outcome: LookupOutcome  # its leases
    # tokens by tier, counted as hits when the workers report the load done (also after its
    # request finished: vLLM frees a request that stopped before it hands over the report)
    hits: dict[str, int]


class ConnectorScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        geometry: KvGeometry,
        identity: ModelIdentity,
        tiers: Tiers,
        no_hits_reason: str | None = None,
        step_tokens: int = 0,
    ) -> None:
        """``no_hits_reason``: this engine cannot compute exactly over a cached prefix
        (``layout.prefix_reuse_refused``): every lookup answers 0 and nothing is saved.
        ``step_tokens``: vLLM's ``max_num_batched_tokens`` (0: not known), which sizes the
        pool space held ahead for saves (``SaveSlab``)."""
        self.config = config
        self.no_hits_reason = no_hits_reason
        self.geometry = geometry
        self.identity = identity
        self.tiers = tiers
        self.pool = tiers.pool
        self.tally = Tally()
        embedded = tiers.embedded
        # An embedded store answers in microseconds: no threads. Staging tiers (a remote pull)
        # take network round trips: lookups then always go to threads.
        inline = embedded and not tiers.staging
        lookup_threads: Executor = (
            InlineExecutor()
            if inline
            else ThreadPoolExecutor(2, thread_name_prefix="kvtier-lookup")
        )
        self.lookups = LookupWaits(
            config, geometry.chunk_tokens, lookup_threads, self._release, self._count
        )
        self._ops: Executor = (
            InlineExecutor() if embedded else ThreadPoolExecutor(1, thread_name_prefix="kvtier-ops")
        )
        self._alloc: Executor = (
            InlineExecutor()
            if embedded
            else ThreadPoolExecutor(1, thread_name_prefix="kvtier-alloc")
        )
        self.resolver = TierResolver(config, geometry, lambda: self.identity, tiers, self._count)
        self.saves = SavePlanner(
            config,
            geometry,
            self.pool,
            self._alloc,
            self._count,
            self.resolver.namespaces,
            self._save_slab(step_tokens) if holds_space(config, geometry, embedded) else None,
        )
        self._requests: dict[str, RequestState] = {}
        self._pending_loads: list[LoadJob] = []
        # req -> tier -> tokens of its last load (vLLM's hit stats read it at admission)
        self.hit_sources: dict[str, dict[str, int]] = {}
        # req id -> its block ids per KV cache group (vLLM's KV cache manager; bound once the
        # scheduler exists), and the id of vLLM's null block (a sliding window's passed blocks)
        self.block_ids_of: Callable[[str], GroupBlocks] | None = None
        self.null_block = 0
        # drops blocks from vLLM's prefix cache (its KV cache manager's evict_blocks)
        self.evict_device_blocks: Callable[[set[int]], None] | None = None
        # loads handed to the workers, by request, until the workers report them
        self._loading: dict[str, _Loading] = {}
        # leases of loads whose request finished while the workers were still copying
        self._release_after_load: dict[str, LookupOutcome] = {}

    def _save_slab(self, step_tokens: int) -> SaveSlab:
        """Pool space held ahead for saves (``holds_space``)."""
        geo, configured = self.geometry, self.config.save_held_chunks

        def size(pool_bytes: int) -> int:
            return slots_target(
                configured, step_tokens, geo.chunk_tokens, geo.chunk_bytes, pool_bytes
            )

        return SaveSlab(self.pool, self._alloc, geo.chunk_bytes, size)

    def bind_blocks(
        self,
        block_ids_of: Callable[[str], GroupBlocks],
        null_block: int,
        evict_device_blocks: Callable[[set[int]], None],
    ) -> None:
        """vLLM's KV cache manager, once its scheduler exists: a request's block ids per KV
        cache group, the null block's id, and dropping blocks from its prefix cache."""
        self.block_ids_of = block_ids_of
        self.null_block = self.saves.null_block = null_block
        self.evict_device_blocks = evict_device_blocks

    # -- namespaces --------------------------------------------------------------------------

    def bump_namespace(self) -> int:
        """Stop reading anything stored before now: a new namespace generation (used when a
        shared store cannot be cleared, e.g. after weights were updated in place)."""
        self.identity = dataclasses.replace(self.identity, generation=self.identity.generation + 1)
        return self.identity.generation

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestState.of(request, self.identity.generation)
            self._requests[request.request_id] = state
        else:
            self._refresh(state)
        return state

    def _known(self, req_id: str) -> RequestState | None:
        """The request's state, following inputs changed since the last hook (a resumed
        streaming session reaches ``update_state_after_alloc`` and ``build_meta`` without
        a lookup)."""
        state = self._requests.get(req_id)
        if state is not None:
            self._refresh(state)
        return state

    def _refresh(self, state: RequestState) -> None:
        if state.refresh(self.identity.generation, self.geometry.chunk_tokens):
            self._drop_outcome(state)
            self.lookups.supersede(state)

    # -- 1. lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, computed: int
    ) -> tuple[int | None, bool]:
        if self.no_hits_reason:
            return 0, False
        state = self._state(request)
        if not state.cacheable or state.no_external or request.skip_reading_prefix_cache:
            return 0, False
        if state.outcome is not None and (state.outcome.consumed or self._stale(state.outcome)):
            # Used already (vLLM rewound the request, e.g. after a failed load), or waited long
            # in the queue: look up, and lease, afresh.
            self._drop_outcome(state)
        if state.outcome is None or state.outcome.computed != computed:
            if state.gave_up_for == computed:
                return 0, False
            if state.lookup is None or state.lookup_for != computed:
                self._drop_outcome(state)
                self.lookups.supersede(state)
                state.outcome = self.resolver.known_miss(state, computed)
                if state.outcome is not None:  # nothing to lease: no round trip, no thread
                    return 0, False
                if not self.lookups.start(state, computed, self.resolver.resolve):
                    self._count(C.LOOKUPS_SHED)
                    return 0, False
            answer = self.lookups.wait(state, request.request_id)
            if answer == "pending":
                return None, False  # vLLM asks again next step; the scheduler never blocks
            if answer == "gave_up":
                state.gave_up_for = computed
                return 0, False
            state.outcome = answer
        tokens = state.outcome.tokens
        return tokens, tokens > 0 and self.config.load_mode == "async"

    def _drop_outcome(self, state: RequestState) -> None:
        if state.outcome is not None and not state.outcome.consumed:
            self._release(state.outcome)
        state.outcome = None

    # -- 2. after vLLM allocated blocks ------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, block_ids: GroupBlocks, num_external_tokens: int
    ) -> None:
        state = self._known(request.request_id)
        if state is None:
            if num_external_tokens:  # cannot happen: we offered nothing. Never trust it.
                self.fail_external(request.request_id, block_ids, 0, num_external_tokens)
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
        if outcome is None or outcome.consumed or outcome.tokens < num_external_tokens:
            # vLLM allocated for a load we did not offer (should not happen). It will use the
            # blocks as loaded, so fail them: vLLM recomputes, nothing wrong is served.
            log.error(
                "kvtier: %s allocated %d external tokens without a matching lookup",
                request.request_id,
                num_external_tokens,
            )
            state.no_external = True
            self.fail_external(
                request.request_id, block_ids, max(state.lookup_for, 0), num_external_tokens
            )
            return
        outcome.consumed = True
        segments: dict[int, SegmentRef] = {}
        failed = ""
        for rank, epoch in outcome.epochs.items():
            segment = self.pool.segment_ref(epoch)
            if segment is None or epoch != self.pool.epoch:
                failed = "the store restarted between lookup and load"
            else:
                segments[rank] = segment
        if failed:
            self._count(C.STALE_EPOCH_LOADS)
        try:
            chunks = load_copies(geo, outcome, block_ids, num_external_tokens, self.null_block)
        except UnfillableBlocks as exc:  # never leave a block vLLM counts as loaded unfilled
            failed, chunks = str(exc), {}
        job = LoadJob(
            req_id=request.request_id,
            segments=segments,
            chunks=chunks,
            is_async=self.config.load_mode == "async",
            verify=self.config.verify_loads,
            failed=failed,
        )
        if not chunks:
            first = outcome.computed // geo.block_size
            n = num_external_tokens // geo.block_size
            job.error_block_ids = tuple(real_blocks(geo, block_ids, first, n, self.null_block))
        self._pending_loads.append(job)
        hits = tokens_by_tier(outcome.sources, num_external_tokens)
        self._loading[request.request_id] = _Loading(job, outcome, hits)
        state.load_tokens = num_external_tokens
        state.save_from_chunk = (outcome.computed + num_external_tokens) // geo.chunk_tokens
        state.saved_upto = max(state.saved_upto, state.save_from_chunk)
        self.hit_sources[request.request_id] = dict(hits)

    def local_hit(self, req_id: str) -> int:
        """vLLM's own hit the last lookup of ``req_id`` was for (where external tokens start)."""
        state = self._requests.get(req_id)
        return max(state.lookup_for, 0) if state is not None else 0

    def fail_external(
        self, req_id: str, block_ids: GroupBlocks, computed: int, num_external_tokens: int
    ) -> None:
        """vLLM counts ``num_external_tokens`` after ``computed`` as loaded: make every block of
        them a load error (vLLM recomputes them). Used when anything went wrong."""
        first = computed // self.geometry.block_size
        n = -(-num_external_tokens // self.geometry.block_size)
        errors = tuple(real_blocks(self.geometry, block_ids, first, n, self.null_block))
        job = LoadJob(req_id, {}, {}, self.config.load_mode == "async", False, "no usable load")
        job.error_block_ids = errors
        self._pending_loads.append(job)

    # -- 3. per step -------------------------------------------------------------------------

    def build_meta(
        self, scheduled: list[tuple[str, int, int]], preempted: set[str] | None = None
    ) -> KvtierMetadata:
        """``scheduled``: (req id, computed tokens before the step, tokens this step)."""
        self.lookups.new_step(running=len(scheduled))
        meta = KvtierMetadata(loads=self._pending_loads)
        self._pending_loads = []
        try:
            for job in meta.loads:
                self._check_dispatch(job)
            self._renew_loading()
            saving = self.config.save != "none" and not self.no_hits_reason
            if saving and self.block_ids_of is not None:
                items = [
                    (state, computed, count)
                    for req_id, computed, count in scheduled
                    if (state := self._known(req_id)) is not None
                ]
                meta.saves, meta.release_blocks = self.saves.plan(
                    items, self.block_ids_of, preempted or set()
                )
        except Exception as exc:  # loads still go out (failed ones fail); saves are dropped
            log.exception("kvtier: planning saves failed: %r", exc)
            self._count(C.HOOK_ERRORS)
            meta.saves = []
            meta.release_blocks = self.saves.drop_all()
        return meta

    def _check_dispatch(self, job: LoadJob) -> None:
        """Last check before the workers copy: the leases must outlive the copy."""
        loading = self._loading.get(job.req_id)
        if job.failed or loading is None or loading.job is not job:
            return
        outcome = loading.outcome
        if outcome.session_generation != self.pool.session_generation:
            # the store ended the session (no heartbeat got through: a frozen store, a starved
            # thread): every lease of it ended at once, whatever its TTL said
            job.failed = "the store ended the session its leases belonged to"
        elif outcome.lease_lost or self._remaining(outcome) < self._ttl(outcome) / 4:
            job.failed = "its lease lapsed (or was about to) before the copy"
        if job.failed:
            self._count(C.LEASE_LAPSED_LOADS)

    def _renew_loading(self) -> None:
        """Keep the leases of loads in flight alive however long the steps take."""
        for loading in self._loading.values():
            outcome = loading.outcome
            if loading.job.failed or outcome.released or outcome.lease_lost:
                continue
            if self._remaining(outcome) < self._ttl(outcome) / 2:
                outcome.leased_at = time.monotonic()
                for lease_id in outcome.lease_ids:
                    self._ops.submit(self._renew, outcome, lease_id)

    def _renew(self, outcome: LookupOutcome, lease_id: int) -> None:
        try:
            # the store may grant less (what is left of the lease's lifetime)
            outcome.granted(self.pool.renew(lease_id, self.config.load_lease_ttl_s))
        except KvtierError as exc:  # expired or unknown: its chunks may be gone
            outcome.lease_lost = True
            log.info("kvtier: lease of a load in flight lost: %s", exc)

    # -- 4. worker results -------------------------------------------------------------------

    def on_worker_output(self, meta: KvtierWorkerMetadata | None) -> None:
        if meta is None:
            return
        # Failed loads first: their blocks taint every save computed over them this step.
        tainted = set(meta.error_blocks)
        for req_id in meta.load_failed:
            self._count(C.LOAD_FAILED_REQUESTS)
            loading = self._loading.get(req_id)
            if loading is not None:
                tainted |= loading.job.all_block_ids()
            state = self._requests.get(req_id)
            if state is not None:
                state.no_external = True  # do not offer the same bytes again
                # vLLM recomputes from the first failed block: those chunks may be saved once
                # a step of this request has recomputed them (``RequestState.recomputes``)
                start = loading.outcome.computed if loading else 0
                first = start // self.geometry.chunk_tokens
                state.save_from_chunk = min(state.save_from_chunk, first)
                state.saved_upto = min(state.saved_upto, first)
                state.unfilled = (start, state.request.num_tokens)
            self._forget_corrupt(req_id, meta.corrupt.get(req_id, set()))
        self.saves.taint(tainted)
        self._evict_device(tainted)
        self.saves.on_reports(meta.saved, meta.save_failed)
        for req_id in set(meta.loaded) | set(meta.load_failed):
            loading = self._loading.pop(req_id, None)  # once: a later report counts nothing
            if loading is not None and req_id not in meta.load_failed:
                for tier, tokens in loading.hits.items():
                    counter = HIT_TOKENS.get(tier)
                    if counter is not None:
                        self._count(counter, tokens)
            state = self._requests.get(req_id)
            if state is not None:
                state.load_tokens = 0
            if loading is not None:
                self._release(loading.outcome)
            orphan = self._release_after_load.pop(req_id, None)
            if orphan is not None:
                self._release(orphan)

    def _evict_device(self, failed: set[int]) -> None:
        """Blocks a load failed to fill out of vLLM's prefix cache (``failed_loads.py``)."""
        if self.block_ids_of is None or self.evict_device_blocks is None:
            return
        doomed = device_blocks_to_evict(self.geometry, failed, self._requests, self.block_ids_of)
        if doomed:
            self.evict_device_blocks(doomed)
            self._count(C.DEVICE_BLOCKS_EVICTED, len(doomed))

    def _forget_corrupt(self, req_id: str, chunks: set[tuple[int, bytes]]) -> None:
        """Delete exactly the chunks whose bytes failed their checksum (``failed_loads.py``)."""
        state = self._requests.get(req_id)
        if state is not None:
            forget_corrupt(state, chunks, self.pool, self._alloc, self._count)

    # -- leases ------------------------------------------------------------------------------

    def _remaining(self, outcome: LookupOutcome) -> float:
        return self._ttl(outcome) - (time.monotonic() - outcome.leased_at)

    def _ttl(self, outcome: LookupOutcome) -> float:
        """What the store granted the outcome's leases (what was asked, where not said)."""
        return outcome.lease_ttl_s or self.config.load_lease_ttl_s

    def _stale(self, outcome: LookupOutcome) -> bool:
        return not outcome.consumed and self._remaining(outcome) < self._ttl(outcome) / 2

    def _release(self, outcome: LookupOutcome) -> None:
        lease_ids = take_leases(outcome)
        if lease_ids:
            self._ops.submit(self.resolver.release_ids, lease_ids)

    def request_finished(self, req_id: str) -> bool:
        """True when vLLM must hold the request's blocks for a save not yet copied."""
        state = self._requests.pop(req_id, None)
        self.hit_sources.pop(req_id, None)
        loading = self._loading.get(req_id)
        if loading is not None and loading.job.is_async:
            # aborted while waiting for its KV (vLLM schedules it only once the load is
            # reported): no hit. A sync load's request finishing before the report ran the
            # step the load was for: its hit is counted at the report.
            loading.hits = {}
        if state is None:
            return False
        self.lookups.supersede(state)
        if state.outcome is not None:
            if state.load_tokens:  # workers may still be copying under these leases
                self._release_after_load[req_id] = state.outcome
            else:
                self._release(state.outcome)
        return self.saves.finish(req_id)

    # -- misc --------------------------------------------------------------------------------

    def _count(self, counter: Counter, value: float = 1) -> None:
        self.tally.add(counter, value)

    def take_stats(self) -> dict[str, float]:
        return self.tally.take()

    def shutdown(self) -> None:
        """Stop the threads; give back every lease still held (saves never sent, lookups never
        used), so a clean exit leaves the store as it found it."""
        self.lookups.shutdown()
        self.saves.shutdown()  # stops the alloc thread once the saves' aborts ran
        for state in self._requests.values():
            self.lookups.supersede(state)
            self._drop_outcome(state)
        for loading in self._loading.values():
            self._release(loading.outcome)
        for outcome in self._release_after_load.values():
            self._release(outcome)
        self._ops.shutdown(wait=True)
