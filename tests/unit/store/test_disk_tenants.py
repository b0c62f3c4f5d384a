"""Tenants on the disk tier, as in the pool: a quota caps what a tenant's chunk files take, a
floor keeps another tenant's files from taking its own, and both hold again after a restart
(a file's header names its namespace's salt digest, so its tenant is known before any engine
registers the namespace).

Catalog-level tests use headers only (no I/O); the store-level ones run an embedded node store
writing real files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys, salt_digest
from kvtier.store.disk.catalog import DiskCatalog, DiskEntry
from kvtier.store.disk.files import HEADER_BYTES, ChunkHeader
from kvtier.store.state.quotas import TenantLimits
from kvtier.tiers import CpuTier, connect

SIZE = 1000  # bytes of data per file in the catalog tests
FILE = HEADER_BYTES + SIZE
A, B = salt_digest("tenant-a"), salt_digest("tenant-b")


def entry(salt: str, n: int) -> DiskEntry:
    key = n.to_bytes(16, "big")
    return DiskEntry(ChunkHeader(b"ns" * 8, key, SIZE, 1, salt), Path(f"/nowhere/{n}"))


def chunk_id(n: int) -> tuple[bytes, bytes]:
    return b"ns" * 8, n.to_bytes(16, "big")


def keys(catalog: DiskCatalog) -> list[int]:
    return sorted(int.from_bytes(k, "big") for keys in catalog.held().values() for k in keys)


def test_a_tenant_at_its_disk_quota_gives_up_its_own_coldest_files():
    catalog = DiskCatalog(
        Path("/nowhere"), 10 * FILE, [TenantLimits("a", (A,), quota_bytes=2 * FILE)]
    )
    catalog.add(entry(B, 0))  # the coldest file of all: another tenant's
    catalog.add(entry(A, 1))
    catalog.add(entry(A, 2))
    catalog.get(chunk_id(1))  # a use: file 1 is now warmer than file 2
    removed = catalog.add(entry(A, 3))
    assert [int.from_bytes(e.header.key, "big") for e in removed] == [2]
    assert keys(catalog) == [0, 1, 3]
    assert catalog.quota_evictions == 1
    assert catalog.tenant_stats()["disk_tenant_used_bytes.a"] == 2 * FILE


def test_a_file_larger_than_its_tenants_quota_is_refused_and_costs_nothing():
    catalog = DiskCatalog(
        Path("/nowhere"), 10 * FILE, [TenantLimits("a", (A,), quota_bytes=FILE - 1)]
    )
    catalog.add(entry(B, 0))
    assert not catalog.admits(A, FILE)
    refused = entry(A, 1)
    assert catalog.add(refused) == [refused]  # the caller unlinks it
    assert keys(catalog) == [0] and catalog.refused == 1


def test_a_floor_keeps_another_tenants_files_when_the_disk_is_full():
    catalog = DiskCatalog(
        Path("/nowhere"), 4 * FILE, [TenantLimits("b", (B,), floor_bytes=2 * FILE)]
    )
    for n in range(3):  # b's files are the coldest
        catalog.add(entry(B, n))
    catalog.add(entry(A, 10))
    removed = catalog.add(entry(A, 11))  # full: b may give one file (3 held, floor 2)
    assert [int.from_bytes(e.header.key, "big") for e in removed] == [0]
    removed = catalog.add(entry(A, 12))  # b at its floor: a's own coldest goes instead
    assert [int.from_bytes(e.header.key, "big") for e in removed] == [10]
    assert keys(catalog) == [1, 2, 11, 12]


def test_the_floor_is_never_crossed_and_an_unroomed_file_is_refused():
    catalog = DiskCatalog(
        Path("/nowhere"), 2 * FILE, [TenantLimits("b", (B,), floor_bytes=2 * FILE)]
    )
    catalog.add(entry(B, 0))
    catalog.add(entry(B, 1))
    assert not catalog.admits(A, FILE)
    refused = entry(A, 2)
    assert catalog.add(refused) == [refused]
    assert keys(catalog) == [0, 1]
    # b's own new file makes room from b's own coldest: a floor never binds its owner
    assert [int.from_bytes(e.header.key, "big") for e in catalog.add(entry(B, 3))] == [0]
    # nothing asked about leaves a tenant behind (unlisted tenants live with their files)
    assert set(catalog.tenant_stats()) == {
        "disk_tenant_used_bytes.b",
        "disk_tenant_floor_bytes.b",
        "disk_tenant_used_bytes.other",
    }


def test_unlisted_tenants_each_get_the_default_quota():
    catalog = DiskCatalog(Path("/nowhere"), 10 * FILE, default_quota=FILE)
    catalog.add(entry(A, 0))
    catalog.add(entry(B, 1))
    assert [int.from_bytes(e.header.key, "big") for e in catalog.add(entry(A, 2))] == [0]
    assert keys(catalog) == [1, 2]
    assert catalog.tenant_stats()["disk_tenant_used_bytes.other"] == 2 * FILE


# -- an embedded node store writing real files ------------------------------------------------

CHUNK = 64 << 10


def namespace(salt: str) -> Namespace:
    return Namespace(
        model="m",
        dtype="float16",
        num_layers=1,
        num_kv_heads=1,
        head_size=8,
        chunk_tokens=4,
        cache_salt=salt,
    )


def store_config(tmp_path: Path, run_dir: str, disk_quota_chunks: int) -> StoreConfig:
    return StoreConfig.model_validate(
        {
            "run_dir": str(tmp_path / run_dir),
            "max_batch_fraction": 1.0,
            "pool": {"capacity": 8 * CHUNK, "page_size": 4096, "prefault": False},
            "disk": {
                "enabled": True,
                "path": str(tmp_path / "disk"),
                "interval_s": 3600,
                "max_pool_share": 1.0,  # one round copies what the test stored
                "write_through": True,
            },
            "tenants": [
                {
                    "name": "a",
                    "cache_salts": ["tenant-a"],
                    "disk_quota": disk_quota_chunks * (CHUNK + HEADER_BYTES),
                }
            ],
        }
    )


@pytest.fixture
def stores(tmp_path: Path) -> Iterator:
    opened: list[CpuTier] = []

    def open_(run_dir: str, disk_quota_chunks: int) -> CpuTier:
        tier = connect(store_config(tmp_path, run_dir, disk_quota_chunks))
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close()


def put(tier: CpuTier, salt: str, n: int, start: int) -> tuple[bytes, list[bytes]]:
    ns_id = tier.namespace_id(namespace(salt), CHUNK)
    ks = prompt_keys(namespace(salt), list(range(4 * start, 4 * (start + n))))
    rng = np.random.default_rng(start)
    tier.put(ns_id, ks, [rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes() for _ in ks])
    return ns_id, ks


def test_a_store_keeps_each_tenant_within_its_disk_quota_across_a_restart(stores):
    tier = stores("run", disk_quota_chunks=3)
    disk = tier.store.disk  # type: ignore[attr-defined]
    b_ns, b_keys = put(tier, B, 2, start=0)
    a_ns, a_keys = put(tier, A, 3, start=10)
    disk.spill_once()
    a_ns, more = put(tier, A, 2, start=20)
    disk.spill_once()
    on_disk = disk.catalog.held()
    assert sorted(on_disk[a_ns]) == sorted(a_keys[2:] + more)  # a's 3 newest
    assert sorted(on_disk[b_ns]) == sorted(b_keys)  # b untouched by a's quota
    stats = disk.stats()
    assert stats["disk_tenant_used_bytes.a"] == 3 * (CHUNK + HEADER_BYTES)
    assert stats["disk_quota_evictions"] == 2
    assert "tenant-a" not in str(stats) and A not in str(stats)  # names, never salts
    tier.close()
    # a new store with a smaller quota for a: the scan attributes every file to its tenant
    # from its header and applies the quota before anything is served
    again = stores("run2", disk_quota_chunks=1)
    disk = again.store.disk  # type: ignore[attr-defined]
    assert disk.stats()["disk_tenant_used_bytes.a"] == CHUNK + HEADER_BYTES
    assert sorted(disk.catalog.held()[b_ns]) == sorted(b_keys)
