"""The namespaces a store knows: what each was registered with, when each was last used, and
the retirement of idle empty ones.

Namespaces are bounded (``max_namespaces``) but not forever: one that holds no chunk (none
committed, being written or pinned: ``PageBook.live``) and that nobody registered, looked up,
allocated into or deleted from for ``namespace_idle_s`` is retired, by the periodic reap and,
least recently used first, by a registration that would exceed the bound. Its id then answers
UNKNOWN_NAMESPACE, as after a restart, and its clients register it again. A namespace with
chunks is never retired. Each namespace belongs to a tenant (``kvtier.store.state.quotas``),
which counts its namespaces; an unlisted tenant is forgotten with its last one.

Not thread-safe: the store calls it under its lock (``salt_of`` excepted).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.store.state.entries import ChunkEntry, NamespaceInfo
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.pages import PageBook
from kvtier.store.state.quotas import TenantBook


class NamespaceTable:
    def __init__(
        self, limits: StoreLimits, pages: PageBook, tenants: TenantBook, counters: dict[str, int]
    ) -> None:
        self.limits = limits
        self.pages = pages  # whose ``live`` says which namespaces still hold chunks
        self.tenants = tenants
        self.counters = counters  # the store's (namespaces_retired)
        self._known: dict[bytes, NamespaceInfo] = {}
        # namespace id -> when it was last registered, looked up, allocated into (...), least
        # recently used first: where retirement looks (``retire_idle``)
        self._used: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def known(self, ns_id: bytes, chunk_bytes: int) -> NamespaceInfo | None:
        """What ``ns_id`` was registered with (None: not registered); NAMESPACE_MISMATCH if
        with another chunk size."""
        known = self._known.get(ns_id)
        if known is not None and known.chunk_bytes != chunk_bytes:
            raise KvtierError(
                ErrorCode.NAMESPACE_MISMATCH,
                f"namespace {ns_id.hex()} is registered with {known.chunk_bytes}-byte "
                f"chunks, not {chunk_bytes}",
            )
        return known

    @property
    def full(self) -> bool:
        return len(self._known) >= self.limits.max_namespaces

    def make_room(self, now: float) -> None:
        """Room for one more namespace: retire idle empty ones, least recently used first
        (LIMIT_EXCEEDED when none is both)."""
        need = len(self._known) - self.limits.max_namespaces + 1
        if self.retire_idle(now, need) < need:
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(self._known)} namespaces registered, none both empty and "
                f"unused for {self.limits.namespace_idle_s} s: store.max_namespaces = "
                f"{self.limits.max_namespaces}",
            )

    def add(self, namespace: Namespace, chunk_bytes: int) -> None:
        ns_id = namespace.root_key()
        tenant = self.tenants.tenant(namespace.cache_salt)
        tenant.namespaces += 1
        self._known[ns_id] = NamespaceInfo(ns_id, chunk_bytes, namespace, tenant)

    def get(self, ns_id: bytes) -> NamespaceInfo:
        """What ``ns_id`` was registered with (UNKNOWN_NAMESPACE: never, or retired)."""
        info = self._known.get(ns_id)
        if info is None:
            raise unknown_namespace(ns_id)
        return info

    def use(self, ns_id: bytes, now: float) -> NamespaceInfo:
        """The namespace ``ns_id`` (``get``), marked used ``now``: not retired for
        ``namespace_idle_s`` from now."""
        info = self.get(ns_id)
        self._used[ns_id] = now
        self._used.move_to_end(ns_id)
        return info

    def check_rename(self, ns_id: bytes, entries: list[ChunkEntry], now: float) -> None:
        """Placeholders (``StoreCore.commit``'s ``as_keys``) take names only in a namespace
        of their own tenant and chunk size."""
        info = self.use(ns_id, now)
        for entry in entries:
            if entry.tenant is not info.tenant:
                raise KvtierError(
                    ErrorCode.PERMISSION_DENIED,
                    "a chunk commits only under a namespace of the tenant that allocated it",
                )
            if entry.size != info.chunk_bytes:
                raise KvtierError(
                    ErrorCode.WRONG_SIZE,
                    f"a {entry.size}-byte chunk cannot commit in namespace {ns_id.hex()} "
                    f"of {info.chunk_bytes}-byte chunks",
                )

    def retire_idle(self, now: float, limit: int | None = None) -> int:
        """Forget namespaces unused for ``namespace_idle_s`` that have no chunk left (none
        stored, being written, or pinned: ``PageBook.live``), least recently used first, at
        most ``limit``. Returns how many. A client still holding a retired id is answered
        UNKNOWN_NAMESPACE, as after a restart, and registers it again."""
        cutoff = now - self.limits.namespace_idle_s
        live = self.pages.live
        retired: list[bytes] = []
        for ns_id, used in self._used.items():
            if used > cutoff or (limit is not None and len(retired) >= limit):
                break  # the rest were used more recently
            if ns_id not in live:
                retired.append(ns_id)
        for ns_id in retired:
            del self._used[ns_id]
            info = self._known.pop(ns_id)
            info.tenant.namespaces -= 1
            self.tenants.forget(info.namespace.cache_salt)
        self.counters["namespaces_retired"] += len(retired)
        return len(retired)

    def salt_of(self, ns_id: bytes) -> str | None:
        """The ``cache_salt`` (tenant) of namespace ``ns_id``, None when it is not registered
        (never, or retired). Without the lock: one dict read, and an id's salt never changes
        (the salt is part of what the id hashes)."""
        info = self._known.get(ns_id)
        return None if info is None else info.namespace.cache_salt

    def check(self) -> None:
        """Assert the table agrees with the tenants and the page book (``StoreCore``'s
        ``check_invariants``)."""
        for tenant in self.tenants.all():
            assert tenant.namespaces == sum(
                1 for i in self._known.values() if i.tenant is tenant
            ), tenant
        # A namespace is retired only once nothing of it is left: every chunk's is known.
        assert self._used.keys() == self._known.keys()
        live = self.pages.live
        assert all(n > 0 and ns in self._known for ns, n in live.items()), live


def unknown_namespace(ns_id: bytes) -> KvtierError:
    """The one answer for a namespace a caller may not use: never registered, retired, or
    another tenant's (``kvtier.store.server.grpc.TenantGate``). One function, so that the
    messages stay byte-identical and no probe tells them apart."""
    return KvtierError(ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns_id.hex()} is not registered")
