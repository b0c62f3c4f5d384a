"""Every counter the connector keeps, declared once: name, help, and where it is exported.

Code counts with the objects (``tally.add(C.LOOKUPS)``), never with strings, so a typo is an
AttributeError at import, not a number that silently never reaches Prometheus. Each counter
becomes ``vllm:kvtier_<name>`` on vLLM's ``/metrics`` and a field of its ``KV Transfer
metrics`` log line; ``internal`` ones (seconds used for rates) are only logged.

Threading: ``Tally`` is shared by the scheduler thread and the connector's worker threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtier.store.api.remote import FetchStatus
from kvtier.store.api.types import AllocStatus
from kvtier.tiers.base import StageResult


@dataclass(frozen=True)
class Counter:
    name: str
    help: str
    internal: bool = False  # logged and used for rates, not exported as a Prometheus counter

    @property
    def prometheus(self) -> str:
        return f"vllm:kvtier_{self.name}"


class C:
    """The connector's counters (a namespace: ``C.LOOKUPS``)."""

    # lookups
    LOOKUPS = Counter("lookups", "Prompts looked up in kvtier's tiers")
    LOOKUP_TOKENS = Counter("lookup_tokens", "Prompt tokens past vLLM's own hit, asked")
    LOOKUPS_PENDING = Counter(
        "lookups_pending", "Times vLLM was told to ask again while a lookup was in flight"
    )
    LOOKUP_ERRORS = Counter("lookup_errors", "Lookups that failed (treated as misses)")
    LOOKUPS_KNOWN_MISS = Counter(
        "lookups_known_miss",
        "Lookups answered 'no hit' on the scheduler thread from the store's shared view of its "
        "chunks, without a round trip or a lookup thread",
    )
    LOOKUPS_SHED = Counter(
        "lookups_shed", "Requests answered 'no hit' because max_pending_lookups were in flight"
    )
    LOOKUP_WAIT_SECONDS = Counter(
        "lookup_wait_seconds", "Seconds the scheduler thread waited for lookups", internal=True
    )
    LOOKUP_DEADLINE_MISSES = Counter(
        "lookup_deadline_misses", "Lookups past lookup_deadline_s, answered as misses"
    )
    CPU_SKIPPED_TOKENS = Counter(
        "cpu_skipped_tokens", "DRAM hits shorter than min_hit_tokens, recomputed instead"
    )
    # loads
    CPU_HIT_TOKENS = Counter("cpu_hit_tokens", "Tokens loaded from the node DRAM pool")
    REMOTE_HIT_TOKENS = Counter("remote_hit_tokens", "Tokens loaded from another node's pool")
    DISK_HIT_TOKENS = Counter(
        "disk_hit_tokens", "Tokens loaded from this node's disk (staged into its pool)"
    )
    LOADED_CHUNKS = Counter("loaded_chunks", "Chunks copied into vLLM's KV")
    LOADED_BYTES = Counter("loaded_bytes", "Bytes copied into vLLM's KV")
    LOAD_SECONDS = Counter("load_seconds", "Seconds spent copying loads", internal=True)
    LOAD_ERROR_BLOCKS = Counter(
        "load_error_blocks", "KV blocks whose load failed and were recomputed"
    )
    LOAD_FAILED_REQUESTS = Counter("load_failed_requests", "Requests with a failed load")
    LEASE_LAPSED_LOADS = Counter(
        "lease_lapsed_loads", "Loads refused because their lease lapsed or was about to"
    )
    STALE_EPOCH_LOADS = Counter(
        "stale_epoch_loads", "Loads refused: the store restarted between lookup and load"
    )
    UNVERIFIED_CHUNKS = Counter(
        "unverified_chunks", "Loaded chunks whose checksum was not known yet (not verified)"
    )
    DEVICE_BLOCKS_EVICTED = Counter(
        "device_blocks_evicted",
        "vLLM prefix-cache blocks evicted after a failed load (never filled, or computed over"
        " blocks that were not)",
    )
    CORRUPT_CHUNKS_DELETED = Counter(
        "corrupt_chunks_deleted", "Chunks deleted from the store after failing their checksum"
    )
    # saves
    SAVED_CHUNKS = Counter("saved_chunks", "Chunks copied from vLLM's KV into the pool")
    SAVED_BYTES = Counter("saved_bytes", "Bytes copied from vLLM's KV into the pool")
    SAVE_SECONDS = Counter("save_seconds", "Seconds spent copying saves", internal=True)
    COMMITTED_CHUNKS = Counter(
        "committed_chunks", "Saved chunks committed (readable by every instance on the node)"
    )
    SAVE_ALLOCATED = Counter("save_allocated", "Chunks given pool space for a save")
    SAVE_EXISTS = Counter("save_exists", "Chunks not saved: already in the pool")
    SAVE_IN_PROGRESS = Counter(
        "save_in_progress", "Chunks not saved: another instance was saving them"
    )
    SAVE_NO_SPACE = Counter(
        "save_no_space", "Chunks not saved: the pool was full of pinned or unwritten chunks"
    )
    SAVE_DEFERRED = Counter(
        "save_deferred", "Steps a save waited on for pool space (sent in a later step)"
    )
    SAVE_ALLOC_TIMEOUTS = Counter(
        "save_alloc_timeouts", "Chunks whose pool space did not come within save_defer_s"
    )
    SAVE_PREEMPTED = Counter(
        "save_preempted",
        "Chunks whose save waiting for pool space was dropped: vLLM preempted the request "
        "(saved once it recomputes them)",
    )
    SAVES_DISCARDED = Counter(
        "saves_discarded_after_failed_load",
        "Chunks not committed: computed in a step over blocks whose load failed",
    )
    SAVE_ERRORS = Counter("save_errors", "Saves that failed (allocation, copy or commit)")
    SAVE_HELD_SPACE = Counter(
        "save_held_space",
        "Chunks saved into pool space the connector held ahead (no wait for the store)",
    )
    SAVE_HELD_DUPLICATES = Counter(
        "save_held_duplicates",
        "Chunks copied into held pool space but stored by another save first (space freed)",
    )
    SAVE_HELD_SHORT = Counter(
        "save_held_short",
        "Saves that found too little held pool space and asked the store for theirs",
    )
    SAVE_NO_STATE = Counter(
        "save_no_state",
        "Chunks of a Mamba hybrid saved as their attention alone: vLLM wrote no recurrent "
        "state at their end (a prefill step ran past it); a hit may pass them, not end on them",
    )
    # the disk tier
    DISK_STAGED_CHUNKS = Counter("disk_staged_chunks", "Chunks staged from this node's disk")
    DISK_STAGED_BYTES = Counter("disk_staged_bytes", "Bytes staged from this node's disk")
    DISK_STAGE_SECONDS = Counter("disk_stage_seconds", "Time spent staging from disk")
    DISK_STAGE_ERRORS = Counter("disk_stage_errors", "Stages from disk that raised")
    DISK_STAGE_SHORT = Counter(
        "disk_stage_short",
        "Stages cut short by a bad or unreadable file, a full pool or the deadline",
    )
    # the remote tier
    REMOTE_HINT_SKIPS = Counter(
        "remote_hint_skips",
        "Remote-tier index queries skipped: the router's word said no other node could "
        "extend this node's run",
    )
    REMOTE_PULLED_CHUNKS = Counter(
        "remote_pulled_chunks", "Chunks pulled from other nodes' stores into this node's"
    )
    REMOTE_FETCHED_BYTES = Counter("remote_fetched_bytes", "Bytes pulled from other nodes")
    REMOTE_FETCH_SECONDS = Counter("remote_fetch_seconds", "Time spent pulling")
    REMOTE_FETCH_ERRORS = Counter("remote_fetch_errors", "Pulls that raised")
    REMOTE_FETCH_HOLDER_MISS = Counter(
        "remote_fetch_holder_miss", "Pulls cut short: the holder no longer had the chunks"
    )
    REMOTE_FETCH_PEER_UNREACHABLE = Counter(
        "remote_fetch_peer_unreachable", "Pulls that found the holder unreachable"
    )
    REMOTE_FETCH_TIMEOUT = Counter("remote_fetch_timeout", "Pulls past their deadline")
    REMOTE_FETCH_BUSY = Counter(
        "remote_fetch_busy", "Pulls cut short: another writer was storing the next chunk here"
    )
    REMOTE_FETCH_REFUSED = Counter(
        "remote_fetch_refused", "Pulls the holder refused (an error, or a location rejected)"
    )
    REMOTE_FETCH_NO_SPACE = Counter(
        "remote_fetch_no_space", "Pulls cut short: no room in this node's pool"
    )
    REMOTE_FETCH_TRANSFER_FAILED = Counter(
        "remote_fetch_transfer_failed", "Pulls whose transfer failed (holder died mid-way)"
    )
    REMOTE_FETCH_CHECKSUM_MISMATCH = Counter(
        "remote_fetch_checksum_mismatch", "Pulls that received bytes failing their checksum"
    )
    REMOTE_INDEX_ERRORS = Counter("remote_index_errors", "Index queries that failed")
    REMOTE_INDEX_REPAIRS = Counter(
        "remote_index_repairs", "Stale index entries removed after a holder miss"
    )
    REMOTE_UNKNOWN_HOLDERS = Counter(
        "remote_unknown_holders", "Holders named by the index whose address is unknown"
    )
    # what the engine waits for: wall time inside the hooks, on the thread vLLM called them
    SCHEDULER_HOOK_SECONDS = Counter(
        "scheduler_hook_seconds",
        "Seconds vLLM's scheduler spent in kvtier's hooks (waiting for lookups included, "
        "except while nothing else was running)",
    )
    WORKER_HOOK_SECONDS = Counter(
        "worker_hook_seconds",
        "Seconds the model runners spent in kvtier's hooks (loads and saves they waited for "
        "included; summed over workers)",
    )
    # containment
    HOOK_ERRORS = Counter(
        "hook_errors", "Exceptions caught in a vLLM hook (that request served without kvtier)"
    )


ALL: tuple[Counter, ...] = tuple(v for v in vars(C).values() if isinstance(v, Counter))
BY_NAME: dict[str, Counter] = {c.name: c for c in ALL}

HIT_TOKENS: dict[str, Counter] = {
    "cpu": C.CPU_HIT_TOKENS,
    "disk": C.DISK_HIT_TOKENS,
    "remote": C.REMOTE_HIT_TOKENS,
}

SAVE_STATUS: dict[AllocStatus, Counter] = {
    AllocStatus.ALLOCATED: C.SAVE_ALLOCATED,
    AllocStatus.EXISTS: C.SAVE_EXISTS,
    AllocStatus.IN_PROGRESS: C.SAVE_IN_PROGRESS,
    AllocStatus.NO_SPACE: C.SAVE_NO_SPACE,
}


def fetch_status_counter(status: FetchStatus) -> Counter | None:
    """The counter of a pull that ended short (None for a complete one)."""
    return {
        FetchStatus.HOLDER_MISS: C.REMOTE_FETCH_HOLDER_MISS,
        FetchStatus.PEER_UNREACHABLE: C.REMOTE_FETCH_PEER_UNREACHABLE,
        FetchStatus.TIMEOUT: C.REMOTE_FETCH_TIMEOUT,
        FetchStatus.REFUSED: C.REMOTE_FETCH_REFUSED,
        FetchStatus.BUSY: C.REMOTE_FETCH_BUSY,
        FetchStatus.NO_SPACE: C.REMOTE_FETCH_NO_SPACE,
        FetchStatus.TRANSFER_FAILED: C.REMOTE_FETCH_TRANSFER_FAILED,
        FetchStatus.CHECKSUM_MISMATCH: C.REMOTE_FETCH_CHECKSUM_MISMATCH,
    }.get(status)


def stage_counters(tier: str, result: StageResult) -> list[tuple[Counter, float]]:
    """What one staging attempt adds to the counters."""
    if tier == "disk":
        return _disk_counters(result)
    if tier != "remote":
        return []
    out: list[tuple[Counter, float]] = []
    if result.chunks:
        out.append((C.REMOTE_PULLED_CHUNKS, result.chunks))
    if result.bytes:
        out.append((C.REMOTE_FETCHED_BYTES, result.bytes))
    if result.seconds:
        out.append((C.REMOTE_FETCH_SECONDS, result.seconds))
    if result.detail == "index":
        out.append((C.REMOTE_INDEX_ERRORS, 1))
    elif result.detail == "unknown holder":
        out.append((C.REMOTE_UNKNOWN_HOLDERS, 1))
    elif result.detail == "error":
        out.append((C.REMOTE_FETCH_ERRORS, 1))
    elif result.detail:
        try:
            short = fetch_status_counter(FetchStatus(result.detail))
        except ValueError:
            short = None
        if short is not None:
            out.append((short, 1))
        if result.detail == FetchStatus.HOLDER_MISS.value:
            out.append((C.REMOTE_INDEX_REPAIRS, 1))
    return out


def _disk_counters(result: StageResult) -> list[tuple[Counter, float]]:
    out: list[tuple[Counter, float]] = []
    if result.chunks:
        out.append((C.DISK_STAGED_CHUNKS, result.chunks))
    if result.bytes:
        out.append((C.DISK_STAGED_BYTES, result.bytes))
    if result.seconds:
        out.append((C.DISK_STAGE_SECONDS, result.seconds))
    if result.detail == "error":
        out.append((C.DISK_STAGE_ERRORS, 1))
    elif result.detail and result.detail not in (
        FetchStatus.OK.value,
        FetchStatus.HOLDER_MISS.value,
    ):
        out.append((C.DISK_STAGE_SHORT, 1))
    return out


class Tally:
    """Counts since the last report (vLLM sums them across workers and steps)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, counter: Counter, value: float = 1) -> None:
        if value:
            with self._lock:
                self._data[counter.name] = self._data.get(counter.name, 0) + value

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._data = self._data, {}
        return out
