"""Bounds on what one request, or one client, may make the store do.

Why: the store serialises its state machine under one lock, and its pool is shared by every
engine (and tenant) on the node. Unbounded, one allocate of two million keys held the lock
for seconds and evicted the whole pool; one client could register namespaces or open
sessions until the store ran out of memory; one tenant could flush every other tenant's
cache. Each bound here is a ``StoreConfig`` field (see its description), except
``namespace_idle_s`` and ``ended_write_quarantine_s`` (not configurable yet: the defaults
below always apply); ``StoreLimits``
carries them into ``StoreCore``, whose defaults keep the state machine unbounded where a
bound would change its semantics (a unit test, the trace simulator), and the served store
always passes the configured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.config.store import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import salt_digest
from kvtier.store.state.quotas import TenantLimits


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_batch_keys: int = 16384  # keys (or lease ids) in one call; checked before the lock
    max_batch_fraction: float = 1.0  # 1.0: an allocate may ask for the whole pool
    max_namespaces: int = 4096
    # An empty namespace (no chunk stored, being written or pinned) unused this long is retired
    # (``StoreCore.reap``, or a registration past max_namespaces): namespaces multiply (salts x
    # TP ranks x LoRA adapters x cache-reset generations) and would otherwise fill the store.
    # Long against a client's gaps between calls, which re-registers a retired one anyway.
    namespace_idle_s: float = 600.0
    max_sessions: int = 65536
    # What one session's leases may hold at once (their count, and the chunks under them):
    # each lease is memory of the store's, and nothing else bounds how many a client takes.
    max_leases_per_session: int = 16384
    max_leased_chunks_per_session: int = 1 << 20
    max_lease_lifetime_s: float = 600.0  # a lease's whole life, renewals included
    # Pages of a write lease the store ended (its TTL or its session's) are held back this long
    # before reuse: the writer may still be copying into them. Longer than any copy.
    ended_write_quarantine_s: float = 30.0
    session_timeout_s: float = 5.0  # a session without a heartbeat this long ends
    tenants: tuple[TenantLimits, ...] = ()
    default_quota_bytes: int | None = None  # per unlisted tenant; None = no cap

    @classmethod
    def from_config(cls, config: StoreConfig) -> StoreLimits:
        """The configured bounds; tenants' raw salts become the digests namespaces carry."""
        return cls(
            max_batch_keys=config.max_batch_keys,
            max_batch_fraction=config.max_batch_fraction,
            max_namespaces=config.max_namespaces,
            max_sessions=config.max_sessions,
            max_leases_per_session=config.max_leases_per_session,
            max_leased_chunks_per_session=config.max_leased_chunks_per_session,
            max_lease_lifetime_s=config.max_lease_lifetime_s,
            session_timeout_s=config.session_timeout_s,
            tenants=tenant_limits(config),
            default_quota_bytes=None if config.default_quota is None else int(config.default_quota),
        )

    def check_batch(self, n: int, what: str = "keys") -> None:
        """Refuse a batch over ``max_batch_keys`` (before any lock is taken or work done)."""
        if n > self.max_batch_keys:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"batch of {n} {what} exceeds store.max_batch_keys = {self.max_batch_keys}",
            )

    def check_share(self, need_pages: int, free_pages: int, num_pages: int, page_size: int) -> None:
        """Refuse an allocate that asks for more than ``max_batch_fraction`` of the pool and
        does not fit in free space (so it would evict): it evicts nothing. A batch that fits
        in free pages always passes (filling an empty pool takes nobody's chunks)."""
        if self.max_batch_fraction >= 1:
            return
        limit = int(self.max_batch_fraction * num_pages)
        if need_pages > limit and need_pages > free_pages:
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"allocate of {need_pages * page_size} bytes exceeds store.max_batch_fraction "
                f"= {self.max_batch_fraction} of the {num_pages * page_size}-byte pool and "
                f"does not fit in its {free_pages * page_size} free bytes: allocate at most "
                f"{limit * page_size} bytes at once",
            )


def tenant_limits(config: StoreConfig, disk: bool = False) -> tuple[TenantLimits, ...]:
    """The configured tenants with their raw salts as the digests namespaces carry, and the
    pool's quotas and floors (``disk``: the disk tier's)."""
    return tuple(
        TenantLimits(
            t.name,
            tuple(salt_digest(s.get_secret_value()) for s in t.cache_salts),
            _bytes(t.disk_quota if disk else t.quota),
            int(t.disk_floor if disk else t.floor),
        )
        for t in config.tenants
    )


def _bytes(value: int | None) -> int | None:
    return None if value is None else int(value)
