"""Saving chunks a step completes: pool space held ahead or asked for off the scheduler
thread, copies done by the workers, commits only for bytes computed over valid KV.

Per step, ``plan`` first takes pool space the connector holds ahead (``SaveSlab``, with a
node store): a save that finds enough for every rank goes out with this step, and its
placeholders commit under the chunks' keys. Otherwise it asks the store for pool pages for
every chunk the step completes (on the ``kvtier-alloc`` thread, one call for every request
and rank of the step: one message on the store's control socket) and waits at most
``save_wait_s`` for the answers, so a slow or hung store never stalls vLLM's scheduler. An
allocation that is late is sent in a later step instead (the chunk's blocks do not change
while the request lives; when it finishes first, ``finish`` tells vLLM to hold its blocks
until the copy, and the workers report the request as finished sending once done); one later
than ``save_defer_s`` is given up (a future miss, never a wrong byte). A model with a sliding
window is the reason for held space: a step later, the window may have freed the blocks.

A save commits when every rank reported its copy (the saves one step's reports complete
commit in one call), unless ``taint`` saw a failed load of any block the chunks were
computed over (the chunk's own blocks or any before them): vLLM computed that step over KV
that was never loaded, so those bytes are garbage under correct keys and are aborted (held
space: given back) instead. The same holds for another request sharing the failed blocks.

A save aborted because its request will compute its chunks again (preempted while waiting for
pool space, computed over a failed load, a copy that failed) moves the request's
``saved_upto`` back to its first chunk: the recompute saves them. For that, every store call
of saves runs on the allocation executor, in order: an abort is submitted before any
allocation asked after it and runs first, so the recompute's allocation never finds a chunk
still IN_PROGRESS under the aborted lease and skips it; and a commit runs after the delete of
a corrupt chunk of the same name queued before it, so a held save's clean copy never commits
as a duplicate of the damaged one.

Threading: every method runs on vLLM's scheduler thread except the store calls, which run on
the ``kvtier-alloc`` executor (one thread, FIFO; inline for an embedded store). The scheduler
thread never waits on it beyond ``save_wait_s`` per step, and not at all for held space.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from kvtier.connector.counters import SAVE_STATUS, C, Counter
from kvtier.connector.group_blocks import GroupBlocks, real_blocks, save_blocks
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import ChunkCopy, SaveJob
from kvtier.connector.request_state import RequestState
from kvtier.connector.save_calls import AllocationAsk, PendingSave, SaveCalls
from kvtier.connector.save_slab import SaveSlab, Slot
from kvtier.core.chunks import SegmentRef
from kvtier.core.config.connector import ConnectorConfig
from kvtier.store.api.types import AllocateResult, AllocStatus, CommitCall
from kvtier.tiers.base import PoolTier

log = logging.getLogger(__name__)

Count = Callable[[Counter, float], None]


@dataclass
class Allocation:
    """Pool space asked for chunks [start, end) of one request, not yet sent to the workers."""

    state: RequestState
    start: int
    end: int
    # per chunk: (KV cache group, the kept blocks it copies), as the request held them
    chunk_blocks: list[list[tuple[int, tuple[int, ...]]]]
    prefix_blocks: frozenset[int]  # every block the chunks' KV was computed over
    future: Future[dict[int, AllocateResult]]
    deadline: float
    session_generation: int  # the store session its write leases belong to
    step: int = 0  # the planner step that read its blocks
    dropped: bool = False


# A sliding window (or a local attention chunk) passes a block every few decoded tokens: a save
# sent a step late finds the blocks its chunk needs freed, and is dropped. Such a model's steps
# wait for pool space.
WINDOW_SAVE_WAIT_S = 0.002


def save_wait(config: ConnectorConfig, geometry: KvGeometry) -> float:
    """How long a step waits for its pool space: ``save_wait_s``, or when unset 0 (the answer
    goes with the next step) and ``WINDOW_SAVE_WAIT_S`` for a model with a sliding window."""
    if config.save_wait_s is not None:
        return config.save_wait_s
    return 0.0 if geometry.blocks_stay else WINDOW_SAVE_WAIT_S


class SavePlanner:
    def __init__(
        self,
        config: ConnectorConfig,
        geometry: KvGeometry,
        tier: PoolTier,
        alloc: Executor,
        count: Count,
        namespaces_of: Callable[..., dict[int, bytes]],
        slab: SaveSlab | None = None,
    ) -> None:
        """``slab``: pool space held ahead (a node store): saves that find enough go out in
        the step that computed their chunks, without waiting for the store."""
        self.config = config
        self.slab = slab
        self.geometry = geometry
        self.tier = tier
        self._alloc = alloc
        self._count = count
        self._waiting: list[Allocation] = []  # FIFO
        self._pending: dict[int, PendingSave] = {}
        self._held: set[str] = set()  # finished requests whose blocks vLLM holds for us
        self._job_ids = 1
        self._step = 0  # plan() calls, one per engine step
        self._block_ids_of: Callable[[str], GroupBlocks] | None = None
        self.null_block = 0  # vLLM's null block id (set by the connector)
        self._calls = SaveCalls(geometry, tier, count, namespaces_of, self.slab)
        self._save_wait_s = save_wait(config, geometry)

    # -- per step ----------------------------------------------------------------------------

    def plan(
        self,
        scheduled: list[tuple[RequestState, int, int]],
        block_ids_of: Callable[[str], GroupBlocks],
        preempted: set[str],
    ) -> tuple[list[SaveJob], list[str]]:
        """Saves to send with this step, and the held requests the workers may now release.
        ``scheduled``: (state, computed tokens before the step, tokens this step)."""
        self._step += 1
        for alloc in self._waiting:
            if not alloc.dropped and alloc.state.request.request_id in preempted:
                self._drop(alloc, C.SAVE_PREEMPTED)  # vLLM freed its blocks already
                # nothing was copied: the request saves these chunks once it recomputes them
                alloc.state.saved_upto = min(alloc.state.saved_upto, alloc.start)
        self._block_ids_of = block_ids_of
        asks: list[AllocationAsk] = []
        jobs: list[SaveJob] = []  # saves into held pool space: out with this step
        started = [a for item in scheduled for a in self._request(*item, block_ids_of, asks, jobs)]
        if self.slab is not None:
            self.slab.maybe_refill()
        if asks:  # the step's allocations: one task, one message to the store
            self._alloc.submit(self._calls.allocate_step, asks)
        fresh = [a.future for a in started]
        if fresh and self._save_wait_s > 0:  # at 0 not even a look (a waiter costs ~20 µs)
            wait_futures(fresh, timeout=self._save_wait_s)
        now = time.monotonic()
        still: list[Allocation] = []
        for alloc in self._waiting:
            if alloc.dropped:
                continue
            if not alloc.future.done():
                if now > alloc.deadline:
                    self._drop(alloc, C.SAVE_ALLOC_TIMEOUTS)
                else:
                    still.append(alloc)
                    self._count(C.SAVE_DEFERRED, 1)
                continue
            job = self._dispatch(alloc)
            if job is not None:
                jobs.append(job)
        self._waiting = still
        waiting_for = {a.state.request.request_id for a in still}
        released = [req_id for req_id in self._held if req_id not in waiting_for]
        self._held.difference_update(released)
        return jobs, released

    def _request(
        self,
        state: RequestState,
        computed: int,
        count: int,
        block_ids_of: Callable[[str], GroupBlocks],
        asks: list[AllocationAsk],
        jobs: list[SaveJob],
    ) -> list[Allocation]:
        geo = self.geometry
        request = state.request
        if not state.cacheable:
            return []
        state.recomputes(computed, count, geo.chunk_tokens)
        limit = request.num_prompt_tokens if self.config.save == "prompt" else request.num_tokens
        end = min(computed + count, limit) // geo.chunk_tokens
        start = max(state.save_from_chunk, state.saved_upto)
        if end <= start:
            return []
        state.saved_upto = end
        blocks = block_ids_of(request.request_id)
        per_chunk = [save_blocks(geo, blocks, c, self.null_block) for c in range(start, end)]
        # a chunk whose kept blocks a sliding window already passed is not saved, nor any
        # before it (a hit needs a prefix): start after the last such chunk
        missing = [i for i, got in enumerate(per_chunk) if got is None]
        if missing:
            self._count(C.SAVE_ERRORS, len(missing))
            start, per_chunk = start + missing[-1] + 1, per_chunk[missing[-1] + 1 :]
        if end <= start:
            return []
        saves = [got for got in per_chunk if got is not None]  # every one, after the cut
        self._count(C.SAVE_NO_STATE, sum(stateless for _, stateless in saves))
        allocations = []
        lo = 0
        while lo < len(saves):  # runs of whole chunks and of chunks without state
            stateless = saves[lo][1]
            hi = lo + 1
            while hi < len(saves) and saves[hi][1] == stateless:
                hi += 1
            chunk_blocks = [groups for groups, _ in saves[lo:hi]]
            alloc = self._save_run(
                state, start + lo, start + hi, chunk_blocks, blocks, stateless, asks, jobs
            )
            if alloc is not None:
                allocations.append(alloc)
            lo = hi
        return allocations

    def _save_run(
        self,
        state: RequestState,
        start: int,
        end: int,
        chunk_blocks: list[list[tuple[int, tuple[int, ...]]]],
        blocks: GroupBlocks,
        stateless: bool,
        asks: list[AllocationAsk],
        jobs: list[SaveJob],
    ) -> Allocation | None:
        """Save chunks [start, end), all whole or all without state: into held space as far
        as it goes (whole chunks: the slots are whole chunks' size), the rest asked for."""
        geo = self.geometry
        bpc = geo.blocks_per_chunk
        computed_over = frozenset(real_blocks(geo, blocks, 0, end * bpc, self.null_block))
        if (
            not stateless
            and self.slab is not None
            and self.slab.enabled
            and state.ns_ids is not None
        ):
            # the first chunks go into held space (as many as it has on every rank), the
            # rest ask the store
            self.slab.note(state.salt, state.ns_ids)
            held = self.slab.take(state.salt, state.ns_ids, end - start)
            job = None
            if held is not None:
                upto = start + len(next(iter(held.values())))
                over = computed_over if upto == end else frozenset(
                    real_blocks(geo, blocks, 0, upto * bpc, self.null_block)
                )  # fmt: skip
                job = self._dispatch_held(state, start, upto, chunk_blocks, over, held)
            if job is not None:
                jobs.append(job)
                chunk_blocks = chunk_blocks[upto - start :]
                start = upto
                if start == end:
                    return None
            self._count(C.SAVE_HELD_SHORT, 1)
        future: Future[dict[int, AllocateResult]] = Future()
        asks.append(AllocationAsk(future, state, start, end, attention_only=stateless))
        alloc = Allocation(
            state,
            start,
            end,
            chunk_blocks,
            computed_over,
            future,
            time.monotonic() + self.config.save_defer_s,
            self.tier.session_generation,
            step=self._step,
        )
        self._waiting.append(alloc)
        return alloc

    def _dispatch(self, alloc: Allocation) -> SaveJob | None:
        try:
            results = alloc.future.result()
        except Exception as exc:
            log.warning("kvtier: no pool space for %s: %s", alloc.state.request.request_id, exc)
            self._count(C.SAVE_ERRORS, 1)
            return None
        if alloc.session_generation != self.tier.session_generation:
            # the store ended the session: its write leases are gone and their pages held
            # back (quarantined) by the store; never copy into them
            self._count(C.SAVE_ERRORS, 1)
            self._alloc.submit(self._calls.abort_got, alloc.future)
            return None
        if alloc.step != self._step and not self._still_held(alloc):
            # late: a sliding window passed some of its blocks (vLLM may have reused them)
            self._count(C.SAVE_ERRORS, 1)
            self._alloc.submit(self._calls.abort_got, alloc.future)
            return None
        chunks: dict[int, list[ChunkCopy]] = {}
        segments: dict[int, SegmentRef] = {}
        leases: dict[int, int] = {}
        counts: dict[int, int] = {}
        for rank, result in results.items():
            segment = self.tier.segment_ref(result.epoch)
            copies = []
            copied = 0  # chunks (a hybrid model's chunk is one copy per group)
            for i, (status, loc) in enumerate(zip(result.statuses, result.locations, strict=True)):
                self._count(SAVE_STATUS[status], 1)
                if status is not AllocStatus.ALLOCATED or loc is None or segment is None:
                    continue
                for group, ids in alloc.chunk_blocks[i]:
                    copies.append(ChunkCopy(loc.extents, 0, 0, ids, loc.key, group))
                copied += 1
            if result.lease_id and (segment is None or not copies):
                self._alloc.submit(self._calls.quiet_abort, result.lease_id)  # never on this thread
                continue
            if copies and segment is not None:
                chunks[rank], segments[rank] = copies, segment
                leases[rank] = result.lease_id
                counts[rank] = copied
        if not chunks:
            return None
        job = SaveJob(self._job_ids, alloc.state.request.request_id, segments, chunks)
        self._job_ids += 1
        self._pending[job.job_id] = PendingSave(
            job, alloc.state, alloc.start, alloc.prefix_blocks, leases, counts
        )
        return job

    def _dispatch_held(
        self,
        state: RequestState,
        start: int,
        end: int,
        chunk_blocks: list[list[tuple[int, tuple[int, ...]]]],
        computed_over: frozenset[int],
        held: dict[int, list[Slot]],
    ) -> SaveJob | None:
        """The save of chunks [start, end) into pool space held ahead, sent with this step;
        None (the slots given back) when a rank's store incarnation is not attached."""
        chunks: dict[int, list[ChunkCopy]] = {}
        segments: dict[int, SegmentRef] = {}
        for rank, slots in held.items():
            segment = self.tier.segment_ref(slots[0].epoch)
            if segment is None or any(slot.epoch != slots[0].epoch for slot in slots):
                assert self.slab is not None
                self.slab.give_back(s for got in held.values() for s in got)
                return None
            segments[rank] = segment
            chunks[rank] = [
                ChunkCopy(slot.location.extents, 0, 0, ids, slot.key, group)
                for slot, groups in zip(slots, chunk_blocks[: end - start], strict=True)
                for group, ids in groups
            ]
        self._count(C.SAVE_HELD_SPACE, end - start)
        job = SaveJob(self._job_ids, state.request.request_id, segments, chunks)
        self._job_ids += 1
        counts = {rank: end - start for rank in held}
        self._pending[job.job_id] = PendingSave(
            job, state, start, computed_over, {}, counts, held=held, end=end
        )
        return job

    def _still_held(self, alloc: Allocation) -> bool:
        """The request still holds every block the allocation copies (always true of a
        full-attention model: its blocks stay while the request lives)."""
        if self.geometry.blocks_stay:
            return True
        if self._block_ids_of is None:
            return False
        try:
            blocks = self._block_ids_of(alloc.state.request.request_id)
        except Exception:  # finished and freed
            return False
        geo, null = self.geometry, self.null_block
        now = [save_blocks(geo, blocks, c, null) for c in range(alloc.start, alloc.end)]
        return [got[0] if got else None for got in now] == alloc.chunk_blocks

    # -- worker reports ----------------------------------------------------------------------

    def taint(self, failed_blocks: set[int]) -> None:
        """Blocks whose load failed: no save computed over any of them may commit (those sent
        and those still waiting for pool space alike)."""
        if not failed_blocks:
            return
        for job_id, pending in list(self._pending.items()):
            if not pending.prefix_blocks.isdisjoint(failed_blocks):
                del self._pending[job_id]
                self._abort_pending(pending, C.SAVES_DISCARDED)
        for alloc in self._waiting:
            if not alloc.dropped and not alloc.prefix_blocks.isdisjoint(failed_blocks):
                self._drop(alloc, C.SAVES_DISCARDED)
                alloc.state.saved_upto = min(alloc.state.saved_upto, alloc.start)

    def on_reports(self, saved: dict[int, set[int]], failed: dict[int, set[int]]) -> None:
        commits: list[CommitCall] = []
        held: list[PendingSave] = []
        for job_id in failed:
            pending = self._pending.pop(job_id, None)
            if pending is not None:
                self._abort_pending(pending, C.SAVE_ERRORS)
        for job_id, ranks in saved.items():
            pending = self._pending.get(job_id)
            if pending is None:
                continue
            pending.done_ranks |= ranks
            if pending.done_ranks >= set(pending.counts):
                del self._pending[job_id]
                if pending.held is not None:
                    held.append(pending)
                for rank, lease_id in pending.leases.items():
                    commits.append(CommitCall(lease_id, None, [0] * pending.counts[rank]))
        if commits or held:  # every save these reports completed: one task, one message
            # behind every store call queued before (FIFO): a delete of a corrupt chunk named
            # like a held save's runs first, or the clean copy would commit as a duplicate
            self._alloc.submit(self._calls.commit_step, commits, held)

    def _abort_pending(self, pending: PendingSave, why: Counter) -> None:
        # chunks, as _drop counts them: a chunk copied on every rank is one chunk, not N
        self._count(why, max(pending.counts.values(), default=0))
        # recompute may save these chunks again once the blocks hold valid KV
        pending.state.saved_upto = min(pending.state.saved_upto, pending.start)
        if pending.held is not None and self.slab is not None:  # behind the copy's report
            self.slab.give_back(slot for slots in pending.held.values() for slot in slots)
        for lease_id in pending.leases.values():
            # ahead of the recompute's allocation (FIFO), which would otherwise find these
            # chunks still IN_PROGRESS and skip them
            self._alloc.submit(self._calls.quiet_abort, lease_id)

    # -- request lifetime --------------------------------------------------------------------

    def finish(self, req_id: str) -> bool:
        """The request finished: True when vLLM must hold its blocks for a save still
        waiting for pool space (the workers report it finished sending after the copy)."""
        if any(a.state.request.request_id == req_id and not a.dropped for a in self._waiting):
            self._held.add(req_id)
            return True
        return False

    def drop_all(self) -> list[str]:
        """Give up every waiting allocation (after an internal error); the held requests."""
        for alloc in self._waiting:
            if not alloc.dropped:
                self._drop(alloc, C.SAVE_ERRORS)
        self._waiting = []
        held, self._held = list(self._held), set()
        return held

    def shutdown(self) -> None:
        """Give up every waiting allocation and stop the alloc thread once it ran what was
        queued: the aborts (every write lease given back), not the allocations."""
        self._calls.closing = True
        self.drop_all()
        if self.slab is not None:
            self.slab.close()
        self._alloc.shutdown(wait=True)

    def _drop(self, alloc: Allocation, why: Counter) -> None:
        alloc.dropped = True
        self._count(why, alloc.end - alloc.start)
        # behind the allocation (FIFO), ahead of any asked after this drop
        self._alloc.submit(self._calls.abort_got, alloc.future)
