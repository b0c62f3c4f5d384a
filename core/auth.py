"""Who is calling, and may they: the one authorization model of every kvtier service.

A call arrives with a bearer token (gRPC ``authorization`` metadata, HTTP ``Authorization``
header), with a client certificate the TLS handshake verified (mTLS), over a Unix socket, or
with nothing. ``Authenticator.principal`` turns that into a ``Principal``: a role (what calls
it may make, ``ROLE_PERMISSIONS``) and, for a tenant's engine, the namespaces it may touch (by
``Namespace.cache_salt``, the salt digest).

Rules (docs/security.md draws the trust boundary they follow):
- No credentials configured: every caller is the anonymous admin. Protected mode
  (``check_exposure``) guarantees such a service listens on loopback or a Unix socket only.
- Credentials configured: a TCP caller must present a known token, also on loopback, or
  (no token) a verified certificate whose identity a credential names (``tls_identity``).
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
from typing import Any

from kvtier.core.config.auth import AuthConfig, Role
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import salt_digest


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
    INDEX_SHARE = "index.share"  # a router replica's view relayed to the others: routers
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
    Role.READER: frozenset({P.INDEX_QUERY, P.INDEX_LIST, P.INDEX_SHARE, P.METRICS}),
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


def tenant_salts(tenants: Iterable[Any]) -> dict[str, list[str]]:
    """``store.tenants`` (``TenantConfig``s) as ``Authenticator`` takes them: tenant name ->
    the salt digests its namespaces carry."""
    return {t.name: [salt_digest(s.get_secret_value()) for s in t.cache_salts] for t in tenants}


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
        # certificate identity -> principal; only ever consulted for a certificate the TLS
        # handshake verified against auth.tls.ca_file (``check_exposure`` refuses a server
        # with such credentials whose listener does not verify client certificates)
        self._identities: dict[str, Principal] = {}
        # every credential's principal by name: for work done later on a principal's behalf
        # (an index follower writes with the rights of the location's registrant)
        self.by_name: dict[str, Principal] = {}
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
            self.by_name[cred.name] = principal
            if cred.token is not None:
                self._principals.append((_digest(cred.token.get_secret_value()), principal))
            if cred.tls_identity is not None and config.tls.verifies_clients:
                self._identities[cred.tls_identity] = principal

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

    def principal(
        self, token: str | None, local: bool = False, certificate: Iterable[str] = ()
    ) -> Principal:
        """The caller, or UNAUTHENTICATED. ``local``: the call came over the Unix socket.
        ``certificate``: the identities (common name, DNS and URI subject alternative names)
        of the client certificate the TLS handshake verified, if any. A token, when
        presented, decides: an unknown one is refused even with a known certificate."""
        if local:
            return LOCAL
        if not self.enabled:
            return ANONYMOUS
        if not token:
            return self._by_certificate(certificate)
        presented = _digest(token)
        found: Principal | None = None
        for digest, principal in self._principals:  # no early exit: constant time per table
            if hmac.compare_digest(digest, presented):
                found = principal
        if found is None:
            raise KvtierError(ErrorCode.UNAUTHENTICATED, "unknown credential")
        return found

    def _by_certificate(self, identities: Iterable[str]) -> Principal:
        found = {self._identities[i] for i in identities if i in self._identities}
        if not found:
            raise KvtierError(ErrorCode.UNAUTHENTICATED, "this service requires a credential")
        if len(found) > 1:  # e.g. its CN names one credential, a SAN another: none is meant
            names = sorted(p.name for p in found)
            raise KvtierError(
                ErrorCode.UNAUTHENTICATED,
                f"the client certificate matches several credentials ({', '.join(names)})",
            )
        return found.pop()


def peer_certificate_identities(peercert: Mapping[str, Any] | None) -> list[str]:
    """The identities a ``tls_identity`` credential may name, from a client certificate as
    ``ssl.SSLObject.getpeercert()`` gives it (a verified one: the server's context has
    ``CERT_REQUIRED`` and ``auth.tls.ca_file``): common names, DNS and URI subject
    alternative names. For HTTP servers; gRPC's come from ``kvtier.core.rpc``."""
    if not peercert:
        return []
    names = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    names += [v for k, v in peercert.get("subjectAltName", ()) if k in ("DNS", "URI")]
    return names


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
    """Before a service listens on ``hosts``: refuse an auth config that cannot work
    (credentials naming certificates on a listener that verifies none) and, as Redis does it
    (protected mode), refuse to listen beyond loopback without a credential that can
    actually authenticate a caller."""
    certified = [c.name for c in config.all_credentials() if c.tls_identity is not None]
    if certified and not config.tls.verifies_clients:
        raise KvtierError(
            ErrorCode.INVALID_ARGUMENT,
            f"{service}: auth credentials {certified} name a tls_identity, which only a "
            "listener that verifies client certificates can check: set auth.tls.cert_file, "
            "auth.tls.key_file (this server's certificate) and auth.tls.ca_file (who signs "
            "the clients'). See docs/security.md.",
        )
    exposed = [h for h in hosts if not is_private_bind(h)]
    if not exposed or not config.protected_mode or config.authenticating_credentials():
        return
    if config.tls.verifies_clients:
        why = (
            "mTLS verifies client certificates, but no credential names one: add "
            "[[auth.credentials]] with a tls_identity (a certificate's CN or DNS/URI SAN) "
            "and a role, or token credentials"
        )
    elif config.tls.ca_file is not None:
        why = (
            "auth.tls.ca_file alone is not a credential: without auth.tls.cert_file and "
            "key_file the listener is plaintext and verifies no certificate. Configure "
            "credentials ([[auth.credentials]] in the config file, auth.credentials_file, or "
            "KVTIER_AUTH__CREDENTIALS), or mTLS with all three auth.tls files and "
            "tls_identity credentials"
        )
    else:
        why = (
            "Configure credentials ([[auth.credentials]] in the config file, "
            "auth.credentials_file, or KVTIER_AUTH__CREDENTIALS), or mTLS (auth.tls "
            "cert_file, key_file and ca_file, with tls_identity credentials)"
        )
    raise KvtierError(
        ErrorCode.INVALID_ARGUMENT,
        f"{service}: refusing to listen on {', '.join(exposed)} without authentication "
        f"(protected mode). {why}; or bind 127.0.0.1 / a Unix socket. See docs/security.md.",
    )
