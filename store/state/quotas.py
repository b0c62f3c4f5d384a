"""Per-tenant quotas and floors: how much of the pool each tenant may hold, and how much of it
no other tenant's allocation may take.

A tenant is the set of namespaces whose ``cache_salt`` (the salt digest, ``kvtier.core.keys``) is
one of its salts. Operators name tenants and list their raw salts (``store.tenants``); every
other salt digest (and the unsalted namespaces, digest '') is a tenant of its own, capped by
``store.default_quota`` and reported as "other". Why: without a cap one tenant's traffic
evicts every other tenant's cache; without a floor a burst from one tenant flushes another's
working set even when both stay within their quotas.

Accounting is in pages and mirrors ``PageBook.pages`` per tenant: ``writing`` (allocated, not
yet committed), ``committed`` and ``pinned`` (committed and read-leased). A tenant *holds*
writing + committed pages; quotas cap that, floors protect it. Names, never salts or digests,
leave this module (stats, metrics, logs).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.core.errors import ErrorCode, KvtierError

OTHER = "other"  # the stats label of every tenant not named in store.tenants


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One named tenant as configured: its salt digests, quota and floor in bytes."""

    name: str
    digests: tuple[str, ...]
    quota_bytes: int | None = None  # None = no cap
    floor_bytes: int = 0


@dataclass(slots=True, eq=False)
class Tenant:
    name: str
    quota: int | None  # pages it may hold; None = no cap
    floor: int  # pages no other tenant's allocation may take from it
    writing: int = 0
    committed: int = 0
    pinned: int = 0  # committed pages under a read lease
    namespaces: int = 0  # registered namespaces of this tenant (the store keeps the count)

    @property
    def held(self) -> int:
        return self.writing + self.committed

    @property
    def evictable(self) -> int:
        return self.committed - self.pinned

    def room(self) -> int | None:
        """Pages it may still take under its quota (None = no cap)."""
        return None if self.quota is None else self.quota - self.held

    def spare_for_others(self) -> int:
        """Pages another tenant's allocation may evict from it: evictable, above its floor."""
        return max(0, min(self.evictable, self.held - self.floor))


class TenantBook:
    """The tenants of one store. With nothing configured every namespace is an uncapped
    "other" tenant, and the store behaves exactly as without quotas."""

    def __init__(
        self,
        page_size: int,
        capacity_pages: int,
        tenants: Iterable[TenantLimits] = (),
        default_quota_bytes: int | None = None,
    ) -> None:
        self.page_size = page_size
        self._default_quota = _pages(default_quota_bytes, page_size)
        self._by_digest: dict[str, Tenant] = {}
        self.named: list[Tenant] = []
        for limits in tenants:
            tenant = Tenant(
                limits.name,
                _pages(limits.quota_bytes, page_size),
                (limits.floor_bytes + page_size - 1) // page_size,
            )
            for digest in limits.digests:
                if digest in self._by_digest:  # the message names the tenants, not the salt
                    raise KvtierError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"store.tenants: tenants {self._by_digest[digest].name!r} and "
                        f"{limits.name!r} list the same cache_salt",
                    )
                self._by_digest[digest] = tenant
            self.named.append(tenant)
        if sum(t.floor for t in self.named) > capacity_pages:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                "store.tenants: the floors add up to more than the pool's capacity",
            )
        # Only tenants with a floor constrain eviction; most stores have none.
        self.floored = [t for t in self.named if t.floor > 0]
        self._others: dict[str, Tenant] = {}  # digest -> tenant of an unlisted salt

    def tenant(self, digest: str) -> Tenant:
        """The tenant of a namespace whose ``cache_salt`` is ``digest`` (made on first use;
        the store bounds how many exist through ``store.max_namespaces``, and ``forget``s an
        unlisted one with its last namespace)."""
        tenant = self._by_digest.get(digest)
        if tenant is None:
            tenant = self._by_digest[digest] = Tenant(OTHER, self._default_quota, 0)
            self._others[digest] = tenant
        return tenant

    def forget(self, digest: str) -> None:
        """Drop the tenant of an unlisted salt ``digest`` if it has no namespace left and
        holds nothing (the store retired its last namespace); ``tenant`` makes it again on
        next use. Named tenants are configuration: always kept."""
        tenant = self._others.get(digest)
        if tenant is not None and not (tenant.namespaces or tenant.held or tenant.pinned):
            del self._others[digest]
            del self._by_digest[digest]

    def evictable_for(self, requester: Tenant, unpinned_pages: int) -> int:
        """Pages ``requester``'s allocation may evict, of the ``unpinned_pages`` committed and
        unpinned in the pool: all but what other tenants' floors protect. Exact up to chunk
        granularity (a floor is protected chunk by chunk, never split)."""
        protected = sum(
            t.evictable - t.spare_for_others() for t in self.floored if t is not requester
        )
        return unpinned_pages - protected

    def may_take(self, requester: Tenant, victim: Tenant, pages: int) -> bool:
        """May ``requester``'s allocation evict a ``pages``-page chunk of ``victim``?"""
        return victim is requester or victim.held - pages >= victim.floor

    def stats(self) -> dict[str, int]:
        """Bytes held per tenant name (unlisted tenants summed as "other"), and the named
        tenants' quotas and floors."""
        out: dict[str, int] = {}
        for tenant in self.named:
            out[f"tenant_used_bytes.{tenant.name}"] = (
                out.get(f"tenant_used_bytes.{tenant.name}", 0) + tenant.held * self.page_size
            )
            if tenant.quota is not None:
                out[f"tenant_quota_bytes.{tenant.name}"] = tenant.quota * self.page_size
            out[f"tenant_floor_bytes.{tenant.name}"] = tenant.floor * self.page_size
        others = sum(t.held for t in self._others.values()) * self.page_size
        out[f"tenant_used_bytes.{OTHER}"] = out.get(f"tenant_used_bytes.{OTHER}", 0) + others
        return out

    def all(self) -> list[Tenant]:
        return [*self.named, *self._others.values()]


def _pages(nbytes: int | None, page_size: int) -> int | None:
    return None if nbytes is None else nbytes // page_size
