"""What the store's state machine keeps per chunk and per namespace (its own, not its API)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.core.keys import Namespace
from kvtier.store.pool.allocator import PageRun
from kvtier.store.state.quotas import Tenant

COUNTERS = (
    "lookups",
    "hit_chunks",
    "miss_chunks",
    "pending_lookups",
    "allocated",
    "exists",
    "in_progress",
    "no_space",
    "commits",
    "aborts",
    "evictions",
    "deletes",
    "clears",
    "released_read",
    "released_write",
    "expired_read",
    "expired_write",
    "quarantined",
    "quarantine_released",
    "quota_evictions",  # a tenant's own chunks evicted to keep it within its quota
    "dirty_evictions",  # chunks evicted before the disk tier had copied them (lost)
    "quota_no_space",  # chunks refused: the tenant is at its quota, nothing of its own to evict
    "sessions_opened",
    "sessions_closed",
    "sessions_expired",  # no heartbeat for store.session_timeout_s: the client is gone
    "session_released_read",  # read leases ended with their session
    "session_released_write",  # write leases aborted with their session
    "namespaces_retired",  # empty and unused for namespace_idle_s: forgotten (see StoreCore)
    "view_hit_chunks",  # chunks engines leased themselves (kvtier.store.client.view_leases)
)


class ChunkState(enum.StrEnum):
    WRITING = "writing"
    COMMITTED = "committed"


@dataclass(slots=True, eq=False)
class ChunkEntry:
    key: bytes
    namespace: bytes
    size: int
    runs: list[PageRun]
    pages: int
    state: ChunkState
    tenant: Tenant  # whose quota the pages count against (the namespace's)
    pins: int = 0
    checksum: int = 0  # XXH3-64 of the bytes; 0 = not computed yet (the store fills it in)
    last_access: float = 0.0
    doomed: bool = False  # unlinked from the table; pages freed once nothing references it
    # unique in this store incarnation, given at commit: how engines' own pins name it
    # (kvtier.store.state.view_pins); 0 while being written
    serial: int = 0
    held_since: float = -1.0  # unlinked while an engine's pin may name it (-1: not held)


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    ns_id: bytes
    chunk_bytes: int
    namespace: Namespace
    tenant: Tenant
