"""The store calls of saves (``SavePlanner``), all on the ``kvtier-alloc`` executor (one
thread, FIFO; inline for an embedded store): a step's allocations in one message, the commits
of the saves a step's reports completed in one message (held space committing under the
chunks' names), and the aborts. Their order is the contract the planner relies on: an abort
runs before any allocation asked after it, a commit after the delete of a corrupt chunk
queued before it.

Threading: every method here runs on that executor, never on vLLM's scheduler thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.connector.counters import C, Counter
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import SaveJob
from kvtier.connector.request_state import RequestState
from kvtier.connector.save_slab import SaveSlab, Slot, by_lease
from kvtier.core.errors import KvtierError
from kvtier.store.api.types import AllocateCall, AllocateResult, CommitCall
from kvtier.tiers.base import PoolTier

log = logging.getLogger(__name__)

Count = Callable[[Counter, float], None]


@dataclass(frozen=True)
class AllocationAsk:
    """An allocation of one step, answered through ``future`` by the step's one pool call."""

    future: Future[dict[int, AllocateResult]]
    state: RequestState
    start: int
    end: int
    attention_only: bool = False  # chunks without state: the sibling namespace, fewer bytes


@dataclass
class PendingSave:
    """A save sent to the workers, waiting for every rank's report."""

    job: SaveJob
    state: RequestState
    start: int
    prefix_blocks: frozenset[int]
    leases: dict[int, int]  # per rank: write lease (asked for this save)
    counts: dict[int, int]  # per rank: chunks to commit
    done_ranks: set[int] = field(default_factory=set)
    held: dict[int, list[Slot]] | None = None  # per rank: pool space held ahead (SaveSlab)
    end: int = 0  # chunks [start, end) (a held save commits them under their keys)


class SaveCalls:
    def __init__(
        self,
        geometry: KvGeometry,
        tier: PoolTier,
        count: Count,
        namespaces_of: Callable[..., dict[int, bytes]],
        slab: SaveSlab | None,
    ) -> None:
        self.geometry = geometry
        self.tier = tier
        self._count = count
        self._namespaces_of = namespaces_of
        self.slab = slab
        self.closing = False  # shutdown: allocations not yet started allocate nothing

    def allocate_step(self, asks: list[AllocationAsk]) -> None:
        """On the alloc thread: one step's allocations, every request and rank in one call to
        the pool (one message to a store that takes batches). Each request's future gets pool
        space for every rank, or an error (with whatever its other ranks got aborted)."""
        geo = self.geometry
        calls: list[AllocateCall] = []
        owners: list[tuple[AllocationAsk, int]] = []
        asked: list[AllocationAsk] = []
        for ask in asks:
            if not ask.future.set_running_or_notify_cancel():
                continue
            if self.closing:
                ask.future.set_result({})
                continue
            try:
                # registered if need be; keyed as whole chunks whatever the namespace
                ns_ids = self._namespaces_of(ask.state, attention_only=ask.attention_only)
                size = geo.attention_bytes if ask.attention_only else geo.chunk_bytes
                for rank, ns_id in ns_ids.items():
                    keys = ask.state.keys(rank, ask.end, geo.chunk_tokens)[ask.start : ask.end]
                    calls.append(AllocateCall(ns_id, keys, [size] * len(keys)))
                    owners.append((ask, rank))
            except Exception as exc:
                ask.future.set_exception(exc)
                continue
            asked.append(ask)
        if not asked:
            return
        try:
            results: list[AllocateResult | KvtierError] = self.tier.allocate_many(calls)
        except Exception as exc:
            for ask in asked:
                ask.future.set_exception(exc)
            return
        got: dict[int, dict[int, AllocateResult]] = {id(ask): {} for ask in asked}
        errors: dict[int, KvtierError] = {}
        for (ask, rank), result in zip(owners, results, strict=True):
            if isinstance(result, KvtierError):
                errors.setdefault(id(ask), result)
            else:
                got[id(ask)][rank] = result
        for ask in asked:
            error = errors.get(id(ask))
            if error is None:
                ask.future.set_result(got[id(ask)])
                continue
            for result in got[id(ask)].values():  # a request needs every rank's space
                if result.lease_id:
                    self.quiet_abort(result.lease_id)
            ask.future.set_exception(error)

    def abort_got(self, future: Future[dict[int, AllocateResult]]) -> None:
        """Abort whatever the allocation of ``future`` got. It ran before this (FIFO)."""
        if not future.done():  # never with one FIFO thread; abort whenever it completes
            future.add_done_callback(self.abort_got)
            return
        if future.cancelled() or future.exception() is not None:
            return
        for result in future.result().values():
            if result.lease_id:
                self.quiet_abort(result.lease_id)

    def commit_step(self, commits: list[CommitCall], held: list[PendingSave]) -> None:
        for pending in held:
            try:
                commits.extend(self._held_commits(pending))
            except Exception as exc:  # its keys or namespaces could not be had: not committed
                log.warning("kvtier: a save into held pool space not committed: %s", exc)
                self._count(C.SAVE_ERRORS, 1)
                assert pending.held is not None and self.slab is not None
                self.slab.give_back(slot for slots in pending.held.values() for slot in slots)
        if not commits:
            return
        try:
            results: list[int | KvtierError] = self.tier.commit_many(commits)
        except KvtierError as exc:
            results = [exc] * len(commits)
        for call, result in zip(commits, results, strict=True):
            n = len(call.checksums)
            if isinstance(result, KvtierError):
                log.warning("kvtier: commit of %d chunks failed: %s", n, result)
                self._count(C.SAVE_ERRORS, 1)
            elif call.as_keys is not None:
                self._count(C.COMMITTED_CHUNKS, result)
                self._count(C.SAVE_HELD_DUPLICATES, n - result)
            else:
                self._count(C.COMMITTED_CHUNKS, n)

    def _held_commits(self, pending: PendingSave) -> list[CommitCall]:
        """A held save's placeholders, committing under its chunks' keys (alloc thread)."""
        assert pending.held is not None
        state, chunk_tokens = pending.state, self.geometry.chunk_tokens
        ns_ids = self._namespaces_of(state)
        calls = []
        for rank, slots in pending.held.items():
            names = state.keys(rank, pending.end, chunk_tokens)[pending.start : pending.end]
            for lease_id, keys, as_keys in by_lease(slots, names):
                checksums = [0] * len(keys)
                calls.append(CommitCall(lease_id, keys, checksums, ns_ids[rank], as_keys))
        return calls

    def quiet_abort(self, lease_id: int) -> None:
        try:
            self.tier.abort(lease_id)
        except KvtierError as exc:
            log.debug("kvtier: abort of lease %d: %s", lease_id, exc)
