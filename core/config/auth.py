"""``[auth]``: who may call kvtier's services, and what this process presents when it calls one.

Secrets come from the config file or the environment, never from a flag (flags show in
``ps``): ``KVTIER_AUTH__TOKEN``, ``auth.token_file`` (a mounted Kubernetes Secret), or the
``[[auth.credentials]]`` table / ``auth.credentials_file``. See docs/security.md.

- ``credentials``: the callers a *service* accepts, each named by a token or by a client
  certificate's identity (``tls_identity``, mTLS), with a role and, for an engine, the
  tenants (``store.tenants`` names) whose namespaces it may touch. Empty = no authentication:
  then a service may bind only loopback or a Unix socket (protected mode).
- ``token``: the one token this process presents to every kvtier service it calls.
- ``tls``: server certificate (and, with ``ca_file``, client certificates: mTLS) for gRPC and
  HTTP; clients verify servers against ``ca_file``.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from kvtier.core.config.section import Section


class Role(enum.StrEnum):
    """What a credential is for (docs/security.md has the table of calls per role)."""

    ADMIN = "admin"  # operators: everything, including clear and snapshots
    ENGINE = "engine"  # a vLLM instance: its tenants' namespaces; index queries/announce
    NODE = "node"  # a store: serve/pull peers' chunks, announce itself to the index
    INDEX = "index"  # the index following a store: snapshot, events, stats
    READER = "reader"  # a router: index queries only
    CLIENT = "client"  # an API user: sends requests through the router


class Credential(Section):
    """One caller a service knows: by a bearer token, or by the identity in a client
    certificate that the service's ``auth.tls.ca_file`` verified (mTLS). Exactly one of the
    two."""

    name: str = Field(description="who holds it (logs, metrics; never the token)")
    token: SecretStr | None = Field(
        None, description="the bearer token (>= 16 characters); or set tls_identity"
    )
    tls_identity: str | None = Field(
        None,
        description="or: a verified client certificate's common name, or one of its DNS or "
        "URI subject alternative names (e.g. spiffe://cluster/ns/kvtier/sa/node). Needs a "
        "server with auth.tls.cert_file, key_file and ca_file; a bearer token, when one is "
        "presented, decides instead",
    )
    role: Role = Field(
        description="admin, engine, node, index, reader or client (docs/security.md)"
    )
    tenants: list[str] = Field(
        default_factory=list,
        description="engine only: store.tenants names whose namespaces it may use; "
        "empty = every namespace",
    )

    @model_validator(mode="after")
    def _check(self) -> Credential:
        if (self.token is None) == (self.tls_identity is None):
            raise ValueError(
                f"auth credential {self.name!r}: set exactly one of token and tls_identity"
            )
        if self.token is not None and len(self.token.get_secret_value()) < 16:
            raise ValueError(f"auth credential {self.name!r}: token shorter than 16 characters")
        if self.tls_identity is not None and not self.tls_identity.strip():
            raise ValueError(f"auth credential {self.name!r}: empty tls_identity")
        if self.tenants and self.role is not Role.ENGINE:
            raise ValueError(f"auth credential {self.name!r}: only an engine has tenants")
        return self


class TlsConfig(Section):
    """TLS for this process's servers and the servers it calls."""

    cert_file: Path | None = Field(None, description="server: PEM certificate chain")
    key_file: Path | None = Field(None, description="server: PEM private key")
    ca_file: Path | None = Field(
        None,
        description="servers: require client certificates signed by it (mTLS); "
        "clients: verify servers against it (and present cert_file/key_file)",
    )
    server_name: str | None = Field(
        None, description="client: the name the server's certificate must carry"
    )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None

    @property
    def verifies_clients(self) -> bool:
        """Whether a server built from this listens with TLS *and* requires client
        certificates signed by ``ca_file`` (mTLS). A ``ca_file`` without ``cert_file`` and
        ``key_file`` leaves the listener plaintext: it verifies nobody."""
        return None not in (self.cert_file, self.key_file, self.ca_file)


class AuthConfig(Section):
    """Who may call this process's services, and what it presents when it calls one."""

    token: SecretStr | None = Field(None, description="what this process presents (env/file)")
    token_file: Path | None = Field(None, description="read the token from this file")
    credentials: list[Credential] = Field(
        default_factory=list, description="the callers this process's services accept"
    )
    credentials_file: Path | None = Field(
        None, description="TOML file of [[credentials]] tables, added to credentials"
    )
    protected_mode: bool = Field(
        True,
        description="refuse to listen beyond loopback/Unix sockets without credentials",
    )
    metrics_public: bool = Field(True, description="/metrics readable without a credential")
    tls: TlsConfig = Field(default_factory=TlsConfig)

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        creds = self.all_credentials()
        names = [c.name for c in creds]
        if len(names) != len(set(names)):
            raise ValueError("auth.credentials: names must be unique")
        tokens = [c.token.get_secret_value() for c in creds if c.token is not None]
        if len(tokens) != len(set(tokens)):
            raise ValueError("auth.credentials: two credentials share a token")
        identities = [c.tls_identity for c in creds if c.tls_identity is not None]
        if len(identities) != len(set(identities)):
            raise ValueError("auth.credentials: two credentials share a tls_identity")
        return self

    @property
    def enabled(self) -> bool:
        """Whether services built from this config demand a credential of every TCP caller:
        some credential is configured, or the listener requires client certificates. A
        ``tls.ca_file`` alone does not count: without a server certificate the listener is
        plaintext and the file only tells this process, as a client, whom to trust."""
        return bool(self.all_credentials()) or self.tls.verifies_clients

    def authenticating_credentials(self) -> list[Credential]:
        """The credentials a caller of a server built from this config can actually present:
        every token; a tls_identity only where the listener verifies client certificates.
        Protected mode wants one of these before a service listens beyond loopback."""
        return [
            c for c in self.all_credentials() if c.token is not None or self.tls.verifies_clients
        ]

    def client_token(self) -> str | None:
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_file is not None:
            return self.token_file.read_text().strip() or None
        return None

    def all_credentials(self) -> list[Credential]:
        extra: list[Credential] = []
        if self.credentials_file is not None:
            data = tomllib.loads(self.credentials_file.read_text())
            extra = [Credential.model_validate(c) for c in data.get("credentials", [])]
        return [*self.credentials, *extra]
