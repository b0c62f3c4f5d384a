"""What a failed load leaves behind, cleared on the scheduler side (``ConnectorScheduler``'s
worker reports): the blocks it failed to fill, taken out of vLLM's own prefix cache with
everything computed over them, and the chunks whose bytes failed their checksum, deleted from
the store so no one loads them again.

Threading: called on vLLM's scheduler thread; the deletes run on the ``kvtier-alloc``
executor (FIFO), ahead of any allocation asked after them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from kvtier.connector.counters import C, Counter
from kvtier.connector.group_blocks import GroupBlocks
from kvtier.connector.layout import KvGeometry
from kvtier.connector.request_state import RequestState
from kvtier.core.errors import KvtierError
from kvtier.tiers.base import PoolTier

log = logging.getLogger(__name__)


def device_blocks_to_evict(
    geometry: KvGeometry,
    failed: set[int],
    request_ids: Iterable[str],
    block_ids_of: Callable[[str], GroupBlocks],
) -> set[int]:
    """Blocks a load failed to fill, with every block after them in any request holding them
    (computed over them). For a sync load vLLM cached them at allocation and, under
    ``kv_load_failure_policy: recompute``, keeps them cached: a request preempted or aborted
    before it recomputes would leave them to the next request with that prefix as a device
    hit on KV that was never there. Empty for hybrid models: they load asynchronously and
    fail whole requests (vLLM caches their blocks only once a load succeeded), so nothing of
    a failed load is in vLLM's cache."""
    if not failed or len(geometry.groups) > 1:
        return set()
    doomed = set(failed)
    for req_id in request_ids:
        try:
            blocks = block_ids_of(req_id)[geometry.groups[0].source]
        except Exception:  # no blocks allocated (waiting)
            continue
        first = next((i for i, b in enumerate(blocks) if b in failed), None)
        if first is not None:
            doomed.update(blocks[first:])
    return doomed


def forget_corrupt(
    state: RequestState,
    chunks: set[tuple[int, bytes]],
    pool: PoolTier,
    alloc: Executor,
    count: Callable[[Counter, float], None],
) -> None:
    """Delete exactly the chunks (rank, key) whose bytes failed their checksum. On the alloc
    thread (FIFO), not the ops thread: ahead of the recompute's allocation, which would
    otherwise find the corrupt chunk still there (EXISTS), not save the clean copy, and leave
    a hole once the delete ran."""
    if not chunks or state.ns_ids is None:
        return
    by_rank: dict[int, list[bytes]] = {}
    for rank, key in chunks:
        by_rank.setdefault(rank, []).append(key)
    for rank, keys in by_rank.items():
        count(C.CORRUPT_CHUNKS_DELETED, len(keys))
        alloc.submit(_quiet_delete, pool, state.ns_ids[rank], keys)
        if state.attention_ns_ids is not None:
            # a model with state: the key may name the chunk's attention alone, or a whole
            # chunk; both go (a clean twin costs a future miss, never a token)
            alloc.submit(_quiet_delete, pool, state.attention_ns_ids[rank], keys)


def _quiet_delete(pool: PoolTier, ns_id: bytes, keys: list[bytes]) -> None:
    try:
        pool.delete(ns_id, keys)
    except KvtierError as exc:
        log.debug("kvtier: delete of %d corrupt chunks: %s", len(keys), exc)
