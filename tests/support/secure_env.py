"""The tokens of every role (docs/security.md) and the environment that configures a service
with them: tokens travel in the environment, as they would from a Secret, never in flags."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.testing.services import Service

TOKENS = {
    "admin": "admin-token-0123456789",
    "engine-a": "engine-a-token-0123456789",
    "engine-b": "engine-b-token-0123456789",
    "engine-all": "engine-all-token-0123456789",
    "node": "node-token-0123456789",
    "index": "index-token-0123456789",
    "reader": "reader-token-0123456789",
}
SALTS = {"a": "salt-of-tenant-a", "b": "salt-of-tenant-b"}


def credentials() -> list[dict]:
    role = {"engine-a": "engine", "engine-b": "engine", "engine-all": "engine"}
    tenants = {"engine-a": ["a"], "engine-b": ["b"]}
    return [
        {
            "name": name,
            "token": token,
            "role": role.get(name, name),
            "tenants": tenants.get(name, []),
        }
        for name, token in TOKENS.items()
    ]


def auth_env(token: str | None = None) -> dict[str, str]:
    env = {
        "KVTIER_AUTH__CREDENTIALS": json.dumps(credentials()),
        "KVTIER_STORE__TENANTS": json.dumps(
            [{"name": t, "cache_salts": [salt]} for t, salt in SALTS.items()]
        ),
    }
    if token is not None:
        env["KVTIER_AUTH__TOKEN"] = token
    return env


@dataclass
class SecureStore:
    service: Service
    socket: Path

    @property
    def address(self) -> str:
        return self.service.address
