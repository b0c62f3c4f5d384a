"""Pool space a connector holds ahead, so a step's saves never wait for the store.

Why: a save needs pool pages before its copy can go out. Asked for in the step that computed
the chunks, the answer from a node store comes back after the step was planned (a control
round trip, longer on a loaded host), so the copy went out a step later. For a model with a
sliding window (or local attention) a step later is too late: the next step frees the
blocks the window passed, and the save is dropped. On a loaded 2-core host that lost every
save of the sliding-window drill. With space held ahead, ``SavePlanner`` takes pages here
on the scheduler thread, the copy goes out with the step that computed the chunks, and the
store only learns the chunks' names when they commit.

How: the slab asks the store for pages under *placeholder* keys (random, in a namespace of
the request's tenant; a write lease like any other allocation, so a dead engine's space is
freed with its session). A save commits its placeholders under the chunks' own keys
(``CommitCall.as_keys``, ``StoreCore.commit``); a name someone else stored meanwhile keeps
its chunk, and that placeholder's pages are freed (counted ``save_held_duplicates``: a copy
made twice, never a chunk overwritten). A save that fails gives its placeholders back
(aborted: the worker may have written half of them). Placeholders are per tenant (a
namespace's ``cache_salt``): the store takes a name only in a namespace of the tenant the
pages were allocated for.

Contracts:
- A slot is taken only with ``min_life_s`` of its write lease left, enough for the copy and
  the commit (the store would otherwise free the pages under a late copy). Older slots are
  given back by the next refill; slots of an ended session (``PoolTier.session_generation``)
  or another store incarnation are forgotten (the store already took them back).
- ``take`` gives every rank of a request as many slots (up to what each has): a chunk
  commits only once every rank copied it; ``SavePlanner`` asks the store for the rest.
- Nothing here ever waits for the store on the scheduler thread: refills and give-backs run
  on the allocation executor (FIFO, one thread), one refill in flight at a time.

Threading: ``take``, ``note`` and ``maybe_refill`` run on vLLM's scheduler thread; ``_refill``
and ``_give_back`` on the allocation executor; one lock guards the slots.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

from kvtier.connector.layout import KvGeometry
from kvtier.core.chunks import ChunkLocation
from kvtier.core.config.connector import ConnectorConfig
from kvtier.core.errors import KvtierError
from kvtier.core.keys import KEY_BYTES
from kvtier.store.api.types import AllocateCall, AllocateResult, AllocStatus
from kvtier.tiers.base import PoolTier

log = logging.getLogger(__name__)

# a slot needs this much of its write lease left to be taken: the copy and the commit run
# within a few steps; the margin covers a stalled worker (the store's default write TTL is 60 s)
MIN_LIFE_S = 15.0
# a refill that failed (the store down or refusing) is not tried again for this long
RETRY_S = 1.0
# a salt's slots are given back after this long without a take (a tenant no longer served)
IDLE_S = 60.0


@dataclass(frozen=True, slots=True)
class Slot:
    """One chunk's pool space, held under a placeholder key."""

    lease_id: int
    key: bytes  # the placeholder
    location: ChunkLocation
    epoch: int  # the store incarnation the extents belong to
    generation: int  # the store session the write lease belongs to
    expires: float  # monotonic: the write lease ends (as seen from here, conservatively)


def holds_space(config: ConnectorConfig, geometry: KvGeometry, embedded: bool) -> bool:
    """Whether saves take pool space held ahead: never with an embedded store (it answers an
    allocation in microseconds); with ``save_held_chunks`` unset, only for a model whose blocks
    a step later may be freed (a sliding window, local attention, Mamba state: a save asked
    for is sent a step later). A full-attention model's blocks stay while its request lives,
    so its saves lose nothing by a step, and holding space measured slower decoding there
    (docs/benchmarks.md, "Pool space held ahead")."""
    if embedded or config.save_held_chunks == 0:
        return False
    return config.save_held_chunks is not None or not geometry.blocks_stay


def slots_target(
    configured: int | None, step_tokens: int, chunk_tokens: int, chunk_bytes: int, pool_bytes: int
) -> int:
    """Chunks per rank to hold: ``configured``, else two full prefill steps' chunks (16 when
    the step is not known: a refill asked for at half, one step's, has a step to come back),
    at most 1/32 of the pool."""
    if configured is not None:
        return configured
    step = -(-step_tokens // chunk_tokens) if step_tokens > 0 else 8
    return min(2 * max(step, 1), pool_bytes // chunk_bytes // 32)


class SaveSlab:
    def __init__(
        self,
        tier: PoolTier,
        executor: Executor,
        chunk_bytes: int,
        size: Callable[[int], int],
        min_life_s: float = MIN_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``size``: the slots to hold per rank given the pool's bytes (asked at the first
        refill, once the store is attached: ``slots_target``)."""
        self.tier = tier
        self.target = -1  # not sized yet
        self._size = size
        self.chunk_bytes = chunk_bytes
        self.min_life_s = min_life_s
        self._executor = executor
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], deque[Slot]] = {}  # (salt, rank) -> oldest first
        self._ns_ids: dict[str, dict[int, bytes]] = {}  # salt -> where its placeholders go
        self._last_take: dict[str, float] = {}
        self._refilling = False
        self._retry_at = 0.0  # a refill failed: the next one not before then
        self._closed = False

    @property
    def enabled(self) -> bool:
        """False once sized to nothing (a pool too small to hold space ahead)."""
        return self.target != 0

    def held(self) -> int:
        """Slots held now in the store attached, over every tenant and rank."""
        live = self._live()
        with self._lock:
            return sum(live(slot) for queue in self._slots.values() for slot in queue)

    def lease_ids(self) -> set[int]:
        """The write leases those slots are under."""
        live = self._live()
        with self._lock:
            return {s.lease_id for queue in self._slots.values() for s in queue if live(s)}

    # -- scheduler thread --------------------------------------------------------------------

    def note(self, salt: str, ns_ids: dict[int, bytes]) -> None:
        """A request of tenant ``salt`` resolved these namespace ids (per rank): the slab
        holds that tenant's space in them from now on."""
        if salt not in self._ns_ids:
            with self._lock:
                self._ns_ids.setdefault(salt, dict(ns_ids))
                self._last_take[salt] = self._clock()

    def take(self, salt: str, ranks: Iterable[int], n: int) -> dict[int, list[Slot]] | None:
        """Up to ``n`` slots, as many on every rank of ``ranks``, for tenant ``salt``; None
        when a rank has none."""
        now = self._clock()
        usable_after = now + self.min_life_s
        live = self._live()
        retired: list[Slot] = []
        try:
            with self._lock:
                self._last_take[salt] = now
                queues = []
                for rank in ranks:
                    queue = self._slots.get((salt, rank))
                    if queue is None:
                        return None
                    while queue and (queue[0].expires < usable_after or not live(queue[0])):
                        retired.append(queue.popleft())
                    n = min(n, len(queue))
                    if not n:
                        return None
                    queues.append((rank, queue))
                return {rank: [queue.popleft() for _ in range(n)] for rank, queue in queues}
        finally:
            self.give_back(slot for slot in retired if live(slot))

    def maybe_refill(self) -> None:
        """Ask for a refill when any tenant's slots run below half the target (or age)."""
        if self._refilling or self._closed:
            return
        now = self._clock()
        if now < self._retry_at:
            return
        with self._lock:
            low = any(
                not (queue := self._slots.get((salt, rank)))
                or len(queue) <= self.target // 2
                or queue[0].expires < now + 2 * self.min_life_s
                for salt, ns_ids in self._ns_ids.items()
                for rank in ns_ids
            )
            if not low:
                return
            self._refilling = True
        self._executor.submit(self._refill)

    def give_back(self, slots: Iterable[Slot]) -> None:
        """Slots a save will not commit (its copy failed, was tainted or was not sent)."""
        slots = list(slots)
        if slots:
            self._executor.submit(self._give_back, slots)

    def close(self) -> None:
        """Give back every slot held (on the executor, which the caller then shuts down)."""
        with self._lock:
            self._closed = True
            held = [slot for queue in self._slots.values() for slot in queue]
            self._slots.clear()
        self.give_back(held)

    def _live(self) -> Callable[[Slot], bool]:
        """Whether a slot belongs to the store incarnation and session attached now (else
        the store already took it back: a restart, or its session ended). Either thread."""
        generation, epoch = self.tier.session_generation, self.tier.epoch
        return lambda slot: slot.generation == generation and slot.epoch == epoch

    # -- allocation executor -----------------------------------------------------------------

    def _refill(self) -> None:
        try:
            self._refill_once()
        except Exception as exc:  # a refill that fails leaves saves asking the store
            log.warning("kvtier: holding pool space for saves failed: %s", exc)
            self._retry_at = self._clock() + RETRY_S
        finally:
            self._refilling = False

    def _refill_once(self) -> None:
        if self.target < 0:
            info = self.tier.info
            self.target = self._size(info.view_offset or info.segment_size)
        now = self._clock()
        live = self._live()
        generation = self.tier.session_generation
        calls: list[AllocateCall] = []
        owners: list[tuple[str, int]] = []
        retired: list[Slot] = []  # given back (the ones the store still has) before asking
        with self._lock:
            for salt in [s for s, at in self._last_take.items() if now - at > IDLE_S]:
                ns_ids = self._ns_ids.pop(salt, {})
                del self._last_take[salt]
                for rank in ns_ids:
                    retired.extend(self._slots.pop((salt, rank), ()))
            for salt, ns_ids in self._ns_ids.items():
                for rank, ns_id in ns_ids.items():
                    queue = self._slots.setdefault((salt, rank), deque())
                    while queue and (
                        queue[0].expires < now + 2 * self.min_life_s or not live(queue[0])
                    ):
                        retired.append(queue.popleft())
                    want = self.target - len(queue)
                    if want > 0:
                        keys = [os.urandom(KEY_BYTES) for _ in range(want)]
                        calls.append(AllocateCall(ns_id, keys, [self.chunk_bytes] * want))
                        owners.append((salt, rank))
        self._give_back([slot for slot in retired if live(slot)])
        if not calls:
            return
        sent = self._clock()
        results = self.tier.allocate_many(calls)
        for (salt, rank), result in zip(owners, results, strict=True):
            if isinstance(result, KvtierError):
                log.info("kvtier: no pool space held ahead for saves: %s", result)
                with self._lock:  # its namespace may be gone (a restart): learnt again
                    self._ns_ids.pop(salt, None)
                continue
            slots = self._slots_of(result, sent, generation)
            if slots and result.lease_ttl_s < 2 * self.min_life_s:
                # every slot would be too old to take before the next refill: holding space
                # would only churn the store (its write leases are short): saves ask instead
                log.warning(
                    "kvtier: the store grants write leases of %.0f s, too short to hold pool "
                    "space ahead for saves (%.0f s needed): saves ask for theirs",
                    result.lease_ttl_s,
                    2 * self.min_life_s,
                )
                self.target = 0
            with self._lock:
                if self._closed or salt not in self._ns_ids or not self.target:
                    self._executor.submit(self._give_back, slots)
                else:
                    self._slots.setdefault((salt, rank), deque()).extend(slots)

    def _slots_of(self, result: AllocateResult, sent: float, generation: int) -> list[Slot]:
        expires = sent + result.lease_ttl_s
        return [
            Slot(result.lease_id, loc.key, loc, result.epoch, generation, expires)
            for status, loc in zip(result.statuses, result.locations, strict=True)
            if status is AllocStatus.ALLOCATED and loc is not None
        ]

    def _give_back(self, slots: list[Slot]) -> None:
        by_lease: dict[int, list[bytes]] = {}
        for slot in slots:
            by_lease.setdefault(slot.lease_id, []).append(slot.key)
        for lease_id, keys in by_lease.items():
            try:
                self.tier.abort(lease_id, keys)
            except KvtierError as exc:  # expired or its session ended: the store took it back
                log.debug("kvtier: giving back held pool space (lease %d): %s", lease_id, exc)


def by_lease(slots: list[Slot], names: list[bytes]) -> list[tuple[int, list[bytes], list[bytes]]]:
    """(write lease, placeholders, names) per lease: how ``slots`` commit as ``names``."""
    grouped: dict[int, tuple[list[bytes], list[bytes]]] = {}
    for slot, name in zip(slots, names, strict=True):
        held, named = grouped.setdefault(slot.lease_id, ([], []))
        held.append(slot.key)
        named.append(name)
    return [(lease_id, held, named) for lease_id, (held, named) in grouped.items()]
