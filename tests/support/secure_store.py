"""A client of the secure store (tests/integration/security/conftest.py) with a role's token,
namespaces of the tenants in ``secure_env.SALTS`` and chunks put there."""

from __future__ import annotations

import numpy as np

from kvtier.core.keys import Namespace, prompt_keys, salt_digest
from kvtier.core.rpc import ClientAuth
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.tiers.cpu import CpuTier

from support.secure_env import SALTS, SecureStore

CHUNK = 4096


def namespace(tenant: str | None) -> Namespace:
    salt = salt_digest(SALTS[tenant]) if tenant else ""
    return Namespace(
        model="m", dtype="bf16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=16,
        cache_salt=salt,
    )  # fmt: skip


def client(store: SecureStore, token: str | None) -> GrpcStoreClient:
    return GrpcStoreClient(store.address, timeout_s=5, auth=ClientAuth(token))


def put_chunks(store: SecureStore, token: str, tenant: str, n: int = 4) -> tuple[bytes, list]:
    ns = namespace(tenant)
    keys = prompt_keys(ns, np.arange(n * ns.chunk_tokens, dtype=np.uint32))
    with CpuTier(client(store, token)) as tier:
        ns_id = tier.register_namespace(ns, CHUNK)
        tier.put(ns_id, keys, [np.full(CHUNK, i, np.uint8) for i in range(n)])
    return ns_id, keys
