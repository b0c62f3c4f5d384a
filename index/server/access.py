"""Who may do what to which location and namespace: the rules the index's API (gRPC and HTTP)
enforces beyond each method's permission (``INDEX_PERMISSIONS``; docs/security.md).

The permission table says which roles may call a method at all; this module says on what.

- **Tenants.** A principal limited to tenants (an engine credential with ``tenants``:
  ``Principal.salts``) sees, queries, registers and writes only namespaces whose
  ``cache_salt`` is one of its tenants' salt digests. Another tenant's namespace, and one
  known by id only (a store's events carry no definition, hence no tenant), answers exactly
  as a namespace never registered: the same code and message in every call (the backends'
  own validators run against the namespaces the caller may see), so no probe tells them
  apart. Lists that name namespaces (locations, stats) leave them out.
- **Locations.** A location is written (apply, replace, heartbeat, unregister, registered
  again) only by the credential that registered it (``Registration.owner``) or an admin. One
  the index follows from its endpoints is written by its follower alone, never over the API,
  admins included: its entries and cursor are the source's own, as the follower read them.
- **Announcing.** Only node and admin credentials announce a node location or a store
  endpoint: the index dials a store, and presents its own credential there only once the
  store proved it holds the registrant's (``index.store_events``). Engines announce
  instances; the index dials their ZMQ publishers, where it presents nothing.
- **Bounds.** Sources followed for registrations (``index.max_dynamic_followers``), the size
  of a namespace definition (``index.max_namespace_bytes``), a claim's TTL
  (``index.max_claim_ttl_s``); the namespace count is the backends' (``max_namespaces``).

Check-then-write: the owner is read, then the backend written, in two steps. A location
unregistered and registered again by another credential between them could take one write
of the former owner; both are authenticated, and the window is one round trip.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvtier.core.auth import Principal
from kvtier.core.chunks import Tier
from kvtier.core.config.auth import Role
from kvtier.core.config.index import IndexConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace
from kvtier.index.api import (
    ApplyStatus,
    ChunkIndex,
    ChunkOp,
    HeartbeatStatus,
    IndexHealth,
    LocationInfo,
    LocationKind,
    LocationStatus,
    Query,
    QueryResult,
    Registration,
)
from kvtier.index.rules import (
    check_holdings,
    check_ops,
    check_registration,
    resolve_keys,
    unknown_location,
    unserved_namespace,
)
from kvtier.store.api.events import EventKind

MAX_HEARTBEAT_LOCATIONS = 4096  # names in one Heartbeat call
_NS_HEX = re.compile(r"[0-9a-f]{32}")


def may_see(principal: Principal, definition: Namespace | None) -> bool:
    """Whether ``principal`` may see and use a namespace (its definition; None: known by id
    only, which names no tenant, so only principals without a tenant restriction see it)."""
    if principal.salts is None:
        return True
    return definition is not None and principal.may_use_salt(definition.cache_salt)


class IndexAccess:
    """The index as one caller may use it: every method takes the caller's ``Principal``
    (``kvtier.core.rpc.caller()`` in gRPC handlers, ``HttpGuard.require``'s in HTTP ones)."""

    def __init__(self, index: ChunkIndex, config: IndexConfig) -> None:
        self.index = index
        self.config = config
        self._vllm = {s.instance for s in config.vllm}
        self._stores = {s.address for s in config.stores}

    # -- namespaces ---------------------------------------------------------------------------

    def _visible(self, principal: Principal, ns_ids: Iterable[bytes]) -> dict[bytes, Any]:
        """The namespaces among ``ns_ids`` that ``principal`` may see, shaped as the known
        namespaces the backends validate against: one it may not see is simply absent, so
        it fails exactly as an unknown one does."""
        out: dict[bytes, Any] = {}
        for ns_id in dict.fromkeys(ns_ids):
            known, definition = self.index.namespace(ns_id)
            if known and may_see(principal, definition):
                out[ns_id] = definition
        return out

    def visible_ids(self, principal: Principal) -> set[bytes] | None:
        """Every namespace ``principal`` may see (None: all of them)."""
        if principal.salts is None:
            return None
        return {ns for ns, d in self.index.namespaces().items() if may_see(principal, d)}

    def namespaces(self, principal: Principal) -> dict[bytes, Namespace | None]:
        known = self.index.namespaces()
        if principal.salts is None:
            return known
        return {ns: d for ns, d in known.items() if may_see(principal, d)}

    def register_namespace(self, principal: Principal, namespace_json: str, ns_id: bytes) -> bytes:
        """A definition (``namespace_json``) or, when empty, an id only."""
        if namespace_json:
            limit = self.config.max_namespace_bytes
            # characters never outnumber bytes: the cheap test first, before any parsing
            if len(namespace_json) > limit or len(namespace_json.encode()) > limit:
                raise KvtierError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"a namespace definition is at most {limit} bytes of JSON "
                    "(index.max_namespace_bytes)",
                )
            try:
                namespace = Namespace.model_validate_json(namespace_json)
            except ValueError as exc:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"bad namespace: {exc}") from None
            if not principal.may_use_salt(namespace.cache_salt):  # as the store answers it
                raise KvtierError(
                    ErrorCode.PERMISSION_DENIED,
                    f"{principal.name} may not use this namespace's tenant (cache_salt)",
                )
            return self.index.register_namespace(namespace)
        if principal.salts is not None:
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                f"{principal.name} may not register a namespace by id only (it names no "
                "tenant): register its definition",
            )
        return self.index.register_namespace(ns_id)

    # -- queries ------------------------------------------------------------------------------

    def query(self, principal: Principal, queries: Sequence[Query]) -> list[QueryResult]:
        if principal.salts is None:
            return self.index.query(queries)
        try:
            visible = self._visible(principal, (q.ns_id for q in queries))
        except KvtierError as exc:
            if exc.code is not ErrorCode.UNAVAILABLE:
                raise
            # as the backend answers while it is unreachable: empty, degraded, for every id
            return [QueryResult(q.ns_id, 0, (), IndexHealth.DEGRADED) for q in queries]
        # keyed here, in order, against what the caller may see: the first bad query fails
        # as it would if the namespaces it may not see were never registered
        keyed = [Query(q.ns_id, keys=resolve_keys(q, visible)) for q in queries]
        return self.index.query(keyed)

    # -- locations ----------------------------------------------------------------------------

    def _configured(self, registration: Registration) -> bool:
        return (
            registration.location in self._vllm
            or registration.endpoints.get("store", "") in self._stores
        )

    def dynamic_sources(self, infos: Iterable[LocationInfo]) -> int:
        """Registrations the index follows that its configuration does not name (up: one
        dropped for silence has no follower until it is registered again)."""
        return sum(
            1
            for i in infos
            if i.status is LocationStatus.UP
            and i.registration.followed
            and not self._configured(i.registration)
        )

    def register(self, principal: Principal, registration: Registration) -> LocationInfo:
        check_registration(registration)
        admin = principal.role is Role.ADMIN
        node_like = registration.kind is LocationKind.NODE or registration.endpoints.get("store")
        if node_like and principal.role is not Role.NODE and not admin:
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                f"{principal.name} ({principal.role}) may not announce a node store: engines "
                "register instance locations, without a store endpoint",
            )
        if principal.salts is not None:
            visible = self._visible(principal, registration.namespaces)
            for ns_id in registration.namespaces:
                if ns_id not in visible:
                    raise unserved_namespace(ns_id)  # what an unknown namespace answers
        existing = self.index.location(registration.location)
        if existing is not None:
            self._check_owner(principal, existing, "register again")
        if (
            registration.followed
            and not self._configured(registration)
            and not (existing is not None and _same_source(existing.registration, registration))
            and self.dynamic_sources(self.index.locations()) >= self.config.max_dynamic_followers
        ):
            raise KvtierError(
                ErrorCode.LIMIT_EXCEEDED,
                f"the index follows at most {self.config.max_dynamic_followers} sources "
                "registered over the API (index.max_dynamic_followers): unregister one first",
            )
        owner = "" if admin else principal.name
        return self.index.register(dataclasses.replace(registration, owner=owner))

    def unregister(self, principal: Principal, location: str) -> bool:
        info = self.index.location(location)
        if info is None:
            return False
        self._check_owner(principal, info, "unregister")
        return self.index.unregister(location)

    def locations(self, principal: Principal) -> list[LocationInfo]:
        infos = self.index.locations()
        visible = self.visible_ids(principal)
        if visible is None:
            return infos
        return [
            dataclasses.replace(
                info,
                registration=dataclasses.replace(
                    info.registration,
                    namespaces=tuple(n for n in info.registration.namespaces if n in visible),
                ),
            )
            for info in infos
        ]

    def heartbeat(self, principal: Principal, locations: Sequence[str]) -> list[HeartbeatStatus]:
        if len(locations) > MAX_HEARTBEAT_LOCATIONS:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT,
                f"at most {MAX_HEARTBEAT_LOCATIONS} locations per heartbeat",
            )
        for name in dict.fromkeys(locations):
            info = self.index.location(name)
            if info is not None:  # an unknown one answers UNKNOWN, as ever
                self._check_writable(principal, info, "heartbeat")
        return self.index.heartbeat(locations)

    # -- writes -------------------------------------------------------------------------------

    def apply(
        self,
        principal: Principal,
        location: str,
        ops: Sequence[ChunkOp],
        *,
        epoch: int,
        seq_from: int,
        seq_to: int,
    ) -> ApplyStatus:
        self._check_writable(principal, self._location(location), "write")
        if principal.salts is not None:
            named = (op.ns_id for op in ops if op.kind is not EventKind.CLEARED)
            check_ops(ops, self._visible(principal, named))
        return self.index.apply(location, ops, epoch=epoch, seq_from=seq_from, seq_to=seq_to)

    def replace(
        self,
        principal: Principal,
        location: str,
        holdings: Mapping[Tier, Mapping[bytes, Sequence[bytes]]],
        *,
        epoch: int,
        seq: int,
    ) -> None:
        self._check_writable(principal, self._location(location), "write")
        if principal.salts is not None:
            named = (ns for by_ns in holdings.values() for ns in by_ns)
            check_holdings(holdings, self._visible(principal, named))
        self.index.replace(location, holdings, epoch=epoch, seq=seq)

    def claim(self, principal: Principal, location: str, owner: str, ttl_s: float) -> bool:
        """Index replicas claim the sources they write on their backend, in process; over
        the API (admins only) a claim pauses the replicas' writes to a source, for at most
        ``index.max_claim_ttl_s``."""
        if not ttl_s > 0 or not owner:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a claim names an owner and a TTL > 0")
        return self.index.claim(location, owner, min(ttl_s, self.config.max_claim_ttl_s))

    def _location(self, name: str) -> LocationInfo:
        info = self.index.location(name)
        if info is None:
            raise unknown_location(name)
        return info

    @staticmethod
    def _check_owner(principal: Principal, info: LocationInfo, what: str) -> None:
        reg = info.registration
        if principal.role is not Role.ADMIN and reg.owner != principal.name:
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                f"{principal.name} may not {what} location {reg.location!r}: another "
                "credential registered it (only it, or an admin, may)",
            )

    def _check_writable(self, principal: Principal, info: LocationInfo, what: str) -> None:
        if info.registration.followed:
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED,
                f"nobody may {what} location {info.registration.location!r} over the API: the "
                "index follows it from its endpoints, and only its follower writes it",
            )
        self._check_owner(principal, info, what)

    # -- stats --------------------------------------------------------------------------------

    def stats(self, principal: Principal, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` (the service's stats) as ``principal`` may see them: namespace ids it may
        not see left out of every list, and out of the sources' error messages."""
        visible = self.visible_ids(principal)
        if visible is None:
            return data
        shown = {ns.hex() for ns in visible}
        out = dict(data)
        if isinstance(out.get("backend"), dict):
            out["backend"] = {**out["backend"], "namespaces": len(visible)}
        out["locations"] = [
            {**loc, "namespaces": [n for n in loc.get("namespaces", ()) if n in shown]}
            for loc in out.get("locations", ())
        ]
        out["sources"] = [
            {**src, "detail": redact(str(src.get("detail", "")), shown)}
            for src in out.get("sources", ())
        ]
        if "health_reason" in out:
            out["health_reason"] = redact(str(out["health_reason"]), shown)
        return out


def redact(text: str, shown: set[str]) -> str:
    """``text`` without the namespace ids (32 hex digits) not in ``shown``."""
    return _NS_HEX.sub(lambda m: m[0] if m[0] in shown else "<namespace>", text)


def _same_source(a: Registration, b: Registration) -> bool:
    return all(a.endpoints.get(n) == b.endpoints.get(n) for n in ("events", "store"))
