"""Who is calling, and may they: the one authorization model of every kvtier service.

A call arrives with a bearer token (gRPC ``authorization`` metadata, HTTP ``Authorization``
header), over a Unix socket, or with nothing. ``Authenticator.principal`` turns that into a
``Principal``: a role (what calls it may make, ``ROLE_PERMISSIONS``) and, for a tenant's
engine, the namespaces it may touch (by ``Namespace.cache_salt``, the salt digest).

Rules (docs/security.md draws the trust boundary they follow):
- No credentials configured: every caller is the anonymous admin. Protected mode
  (``check_exposure``) guarantees such a service listens on loopback or a Unix socket only.
- Credentials configured: a TCP caller must present a known token, also on loopback.
- A Unix-socket caller is the node's own (the socket lives in a 0700 directory of the store's
  uid, so the kernel has checked its uid): the local admin.
Tokens are compared as SHA-256 digests in constant time; a token never reaches a log.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier.config_auth import AuthConfig, Role
from kvtier.errors import ErrorCode, KvtierError


class Permission(enum.StrEnum):
    STORE_INFO = "store.info"  # the store's identity and pool geometry
    STORE_DATA = "store.data"  # namespaces, lookup, allocate/commit, leases, delete own keys
    STORE_OBSERVE = "store.observe"  # snapshot, events, stats: reveals every namespace
    STORE_ADMIN = "store.admin"  # clear the pool
    STORE_PEER = "store.peer"  # lease chunks for a peer, pull chunks from a peer
    INDEX_QUERY = "index.query"  # who holds which chunk
    INDEX_LIST = "index.list"  # every namespace's definition (all tenants): routers, admins
    INDEX_ANNOUNCE = "index.announce"  # register/heartbeat a location (the index follows it)
    INDEX_WRITE = "index.write"  # apply/replace chunk holdings, namespaces
    INDEX_ADMIN = "index.admin"  # drop/reap locations
    METRICS = "metrics"  # /metrics when not public
    ROUTE = "route"  # send OpenAI requests through the router
    # callable without a credential: ``Prove`` only (a service proving who it is before the
    # caller presents its own token), so it must reveal nothing but that proof
    PUBLIC = "public"


P = Permission
ROLE_PERMISSIONS: Mapping[Role, frozenset[Permission]] = {
    Role.ADMIN: frozenset(Permission),
    Role.ENGINE: frozenset(
        {P.STORE_INFO, P.STORE_DATA, P.INDEX_QUERY, P.INDEX_ANNOUNCE, P.INDEX_WRITE, P.METRICS}
    ),
    Role.NODE: frozenset(
        {
            *(P.STORE_INFO, P.STORE_PEER, P.STORE_DATA),
            *(P.INDEX_QUERY, P.INDEX_ANNOUNCE, P.INDEX_WRITE, P.METRICS),
        }
    ),
    Role.INDEX: frozenset({P.STORE_INFO, P.STORE_OBSERVE, P.METRICS}),
    Role.READER: frozenset({P.INDEX_QUERY, P.INDEX_LIST, P.METRICS}),
    Role.CLIENT: frozenset({P.ROUTE}),
}


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``salts``: the salt digests whose namespaces it may use
    (``None``: all of them)."""

    name: str
    role: Role
    salts: frozenset[str] | None = None

    def can(self, permission: Permission) -> bool:
        return permission in ROLE_PERMISSIONS[self.role]

    def may_use_salt(self, salt_digest: str) -> bool:
        return self.salts is None or salt_digest in self.salts

    def require(self, permission: Permission, what: str) -> None:
        if not self.can(permission):
            raise KvtierError(
                ErrorCode.PERMISSION_DENIED, f"{self.name} ({self.role}) may not {what}"
            )


ANONYMOUS = Principal("anonymous", Role.ADMIN)  # no credentials configured (loopback only)
LOCAL = Principal("local", Role.ADMIN)  # over the node's Unix socket
# the caller of a PUBLIC method, whoever it is: no role's calls, no tenant's namespaces
UNAUTHENTICATED = Principal("unauthenticated", Role.CLIENT, frozenset())

PROOF_CONTEXT = b"kvtier-endpoint-proof-v1\0"
NONCE_BYTES = (16, 64)  # the sizes of challenge a prover accepts


def prove(token: str, nonce: bytes) -> bytes:
    """What a service answers to the challenge ``nonce``: proof that it holds ``token``
    without revealing it (HMAC keyed by the token's digest, which the verifier holds)."""
    return hmac.new(_digest(token), PROOF_CONTEXT + nonce, hashlib.sha256).digest()


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps what a caller presented to a ``Principal``. Thread-safe (immutable)."""

    def __init__(
        self, config: AuthConfig, tenant_salts: Mapping[str, Iterable[str]] | None = None
    ) -> None:
        """``tenant_salts``: tenant name -> salt digests (from ``store.tenants``); a
        credential naming a tenant not listed there is a config error."""
        self.enabled = config.enabled
        tenant_salts = tenant_salts or {}
        self._principals: list[tuple[bytes, Principal]] = []
        for cred in config.all_credentials():
            salts: frozenset[str] | None = None
            if cred.tenants:
                unknown = [t for t in cred.tenants if t not in tenant_salts]
                if unknown and tenant_salts:
                    raise KvtierError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"auth credential {cred.name!r} names unknown tenants {unknown} "
                        "(define them in store.tenants)",
                    )
                salts = frozenset(s for t in cred.tenants for s in tenant_salts.get(t, ()))
            principal = Principal(cred.name, cred.role, salts)
            self._principals.append((_digest(cred.token.get_secret_value()), principal))

    def verify_proof(self, nonce: bytes, proof: bytes, roles: Iterable[Role]) -> Principal | None:
        """The credential among ``roles`` whose holder answered ``nonce`` with ``proof``
        (``prove``), or None. How a caller checks an endpoint it is about to present its own
        token to: an address anyone could have named proves it is a kvtier service holding
        such a credential first (docs/security.md, "Dialing")."""
        wanted = frozenset(roles)
        found: Principal | None = None
        for digest, principal in self._principals:  # no early exit, as in ``principal``
            expected = hmac.new(digest, PROOF_CONTEXT + nonce, hashlib.sha256).digest()
            if hmac.compare_digest(expected, proof) and principal.role in wanted:
                found = principal
        return found

    def principal(self, token: str | None, local: bool = False) -> Principal:
        """The caller, or UNAUTHENTICATED. ``local``: the call came over the Unix socket."""
        if local:
            return LOCAL
        if not self.enabled:
            return ANONYMOUS
        if not token:
            raise KvtierError(ErrorCode.UNAUTHENTICATED, "this service requires a credential")
        presented = _digest(token)
        found: Principal | None = None
        for digest, principal in self._principals:  # no early exit: constant time per table
            if hmac.compare_digest(digest, presented):
                found = principal
        if found is None:
            raise KvtierError(ErrorCode.UNAUTHENTICATED, "unknown credential")
        return found


def bearer(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def is_private_bind(host: str) -> bool:
    """Whether binding ``host`` exposes nothing beyond this machine (loopback, Unix socket)."""
    if host.startswith("unix:") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: may resolve to anything


def check_exposure(service: str, hosts: Iterable[str], config: AuthConfig) -> None:
    """Protected mode, as Redis does it: refuse to listen beyond loopback without auth."""
    exposed = [h for h in hosts if not is_private_bind(h)]
    if exposed and not config.enabled and config.protected_mode:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"{service}: refusing to listen on {', '.join(exposed)} without authentication "
            "(protected mode). Configure credentials ([[auth.credentials]] in the config "
            "file, auth.credentials_file, or KVTIER_AUTH__CREDENTIALS) or mTLS (auth.tls), or "
            "bind 127.0.0.1 / a Unix socket. See docs/security.md.",
        )
