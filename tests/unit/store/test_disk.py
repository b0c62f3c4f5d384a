"""The node store's disk tier, embedded (no process): chunks copied to files before eviction,
staged back with the same bytes, found again by a new store, and every bad file a miss.

- write-back: the coldest chunks of a full pool are copied first, so the ones eviction takes
  are already on disk; write-through copies everything;
- a store started on the same directory (after ``close`` or a crash's leftovers) serves the
  same chunks, and refuses to share the directory with a live store;
- a truncated, torn, corrupted or foreign file, a temporary file a crash left, and EIO /
  ENOSPC / a read-only filesystem (injected: nothing else makes them on demand) each end in a
  miss and a cleaned-up entry, never in bytes that differ from what was stored.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.remote import FetchStatus
from kvtier.store.client.shm import checksum_views
from kvtier.store.disk import files
from kvtier.store.disk.files import TMP_MARK, BadChunkFile, chunk_path
from kvtier.tiers import CpuTier, connect

CHUNK = 64 << 10
POOL_CHUNKS = 8


def namespace() -> Namespace:
    return Namespace(
        model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
    )


def config(
    tmp_path: Path, run_dir: str = "run", pool_chunks: int = POOL_CHUNKS, **disk: object
) -> StoreConfig:
    return StoreConfig.model_validate(
        {
            "run_dir": str(tmp_path / run_dir),
            # a pool this small would refuse most batches (store.max_batch_fraction)
            "max_batch_fraction": 1.0,
            "pool": {"capacity": pool_chunks * CHUNK, "page_size": 4096, "prefault": False},
            "disk": {
                "enabled": True,
                "path": str(tmp_path / "disk"),
                "interval_s": 3600,
                "max_pool_share": 1.0,  # one round copies what these tests stored
                **disk,
            },
        }
    )


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator:
    opened: list[CpuTier] = []

    def open_(pool_chunks: int = POOL_CHUNKS, **disk: object) -> CpuTier:
        tier = connect(config(tmp_path, pool_chunks=pool_chunks, **disk))
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close()


def chunks(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes() for _ in range(n)]


def keys_of(n: int, start: int = 0) -> list[bytes]:
    return prompt_keys(namespace(), list(range(4 * start, 4 * (start + n))))


def disk_of(tier: CpuTier):
    backend = tier.store.disk  # type: ignore[attr-defined]
    assert backend is not None
    return backend


def read_back(tier: CpuTier, ns_id: bytes, keys: list[bytes]) -> list[bytes]:
    lease = tier.read(ns_id, keys)
    try:
        return [lease.read(i) for i in range(len(lease))]
    finally:
        lease.release()


def test_write_through_copies_every_chunk_and_a_stage_brings_back_the_same_bytes(open_store):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys, data = keys_of(4), chunks(4, seed=1)
    tier.put(ns_id, keys, data)
    assert disk_of(tier).spill_once().chunks == 4
    tier.delete(ns_id, keys)
    result = tier.stage_from_disk(ns_id, keys, timeout_s=5)
    assert (result.status, result.local, result.fetched) == (FetchStatus.OK, 4, 4)
    assert read_back(tier, ns_id, keys) == data


def test_write_back_copies_the_coldest_so_evicted_chunks_come_back(open_store):
    tier = open_store(high_watermark=0.5)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    cold, hot = keys_of(4), keys_of(4, start=4)
    cold_data = chunks(4, seed=2)
    tier.put(ns_id, cold, cold_data)
    assert disk_of(tier).spill_once().message == "below the high watermark"
    tier.put(ns_id, hot, chunks(4, seed=3))
    spilled = disk_of(tier).spill_once()
    assert spilled.chunks == 4  # the coldest half of the pool: the first prompt
    assert all((ns_id, key) in disk_of(tier).catalog for key in cold)
    assert not any((ns_id, key) in disk_of(tier).catalog for key in hot)
    tier.put(ns_id, keys_of(4, start=8), chunks(4, seed=4))  # evicts the cold chunks
    assert tier.prefix_length(ns_id, cold) == 0
    result = tier.stage_from_disk(ns_id, cold, timeout_s=5)
    assert (result.status, result.local) == (FetchStatus.OK, 4)
    assert read_back(tier, ns_id, cold) == cold_data


def test_a_new_store_on_the_directory_serves_the_same_chunks(open_store, tmp_path):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys, data = keys_of(3), chunks(3, seed=5)
    tier.put(ns_id, keys, data)
    disk_of(tier).spill_once()
    with pytest.raises(KvtierError, match="another store uses the disk tier"):
        connect(config(tmp_path, run_dir="run2"))
    tier.close()
    # what a crash mid-write leaves: a temporary file beside the finished ones
    leftover = chunk_path(tmp_path / "disk", ns_id, keys[0]).with_name(f"x{TMP_MARK}1-1")
    leftover.write_bytes(b"half a chunk")
    again = open_store()
    assert disk_of(again).scan.chunks == 3 and disk_of(again).scan.removed_partial == 1
    assert not leftover.exists()
    ns_id = again.namespace_id(namespace(), CHUNK)
    result = again.stage_from_disk(ns_id, keys, timeout_s=5)
    assert (result.status, result.local) == (FetchStatus.OK, 3)
    assert read_back(again, ns_id, keys) == data


def damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def damage_flip_data(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_tear_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_swap(path: Path) -> None:
    """Another chunk's (valid) file under this chunk's name."""
    sibling = sorted(p for p in path.parent.parent.rglob("*") if p.is_file() and p != path)[0]
    path.write_bytes(sibling.read_bytes())


@pytest.mark.parametrize(
    "damage", [damage_truncate, damage_flip_data, damage_tear_header, damage_swap]
)
def test_a_bad_file_is_a_miss_from_that_chunk_on_and_is_removed(open_store, damage):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys, data = keys_of(4), chunks(4, seed=6)
    tier.put(ns_id, keys, data)
    disk_of(tier).spill_once()
    tier.delete(ns_id, keys)
    bad = chunk_path(disk_of(tier).root, ns_id, keys[2])
    damage(bad)
    result = tier.stage_from_disk(ns_id, keys, timeout_s=5)
    assert result.local == 2  # the chunks before the bad one, never the bad one
    assert result.status in (FetchStatus.CHECKSUM_MISMATCH, FetchStatus.TRANSFER_FAILED)
    assert read_back(tier, ns_id, keys) == data[:2]
    assert not bad.exists() and (ns_id, keys[2]) not in disk_of(tier).catalog
    assert disk_of(tier).stats()["disk_bad_files"] == 1
    again = tier.stage_from_disk(ns_id, keys, timeout_s=5)
    assert (again.status, again.local) == (FetchStatus.HOLDER_MISS, 2)


def test_a_scan_removes_files_that_are_not_whole_chunks(open_store, tmp_path):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys = keys_of(3)
    tier.put(ns_id, keys, chunks(3, seed=7))
    disk_of(tier).spill_once()
    root = disk_of(tier).root
    tier.close()
    damage_truncate(chunk_path(root, ns_id, keys[0]))
    damage_tear_header(chunk_path(root, ns_id, keys[1]))
    again = open_store()
    assert (disk_of(again).scan.chunks, disk_of(again).scan.removed_bad) == (1, 2)
    assert not chunk_path(root, ns_id, keys[0]).exists()


def test_the_disk_capacity_keeps_the_most_recently_used(open_store):
    tier = open_store(write_through=True, capacity=3 * (CHUNK + files.HEADER_BYTES), pool_chunks=2)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys = keys_of(5)
    for i, key in enumerate(keys):  # one at a time, so the disk sees them in order
        tier.put(ns_id, [key], chunks(1, seed=10 + i))
        disk_of(tier).spill_once()
    held = [(ns_id, key) in disk_of(tier).catalog for key in keys]
    assert held == [False, False, True, True, True]
    assert disk_of(tier).catalog.used <= 3 * (CHUNK + files.HEADER_BYTES)
    assert not chunk_path(disk_of(tier).root, ns_id, keys[0]).exists()


def fail_with(code: int):
    def fail(*args: object, **kwargs: object) -> int:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EROFS])
def test_a_failed_write_leaves_no_file_and_no_entry(open_store, monkeypatch, code):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys = keys_of(2)
    tier.put(ns_id, keys, chunks(2, seed=8))
    monkeypatch.setattr(files.os, "pwritev", fail_with(code))
    assert disk_of(tier).spill_once().chunks == 0
    assert len(disk_of(tier).catalog) == 0
    assert not [p for p in disk_of(tier).root.rglob("*") if p.is_file() and p.name != ".lock"]
    monkeypatch.undo()
    again = disk_of(tier).spill_once()
    if code == errno.ENOSPC:  # room was made: writing goes on at once
        assert again.chunks == 2
    else:  # EIO, read-only: writes pause (reads go on)
        assert again.chunks == 0 and again.message.startswith("writes paused")
    assert disk_of(tier).stats()["disk_write_errors"] == 1


def test_a_read_error_is_a_miss_and_drops_the_entry(open_store, monkeypatch):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys, data = keys_of(2), chunks(2, seed=9)
    tier.put(ns_id, keys, data)
    disk_of(tier).spill_once()
    tier.delete(ns_id, keys)
    monkeypatch.setattr(files.os, "preadv", fail_with(errno.EIO))
    result = tier.stage_from_disk(ns_id, keys, timeout_s=5)
    assert (result.status, result.local) == (FetchStatus.TRANSFER_FAILED, 0)
    assert len(disk_of(tier).catalog) == 0
    assert tier.prefix_length(ns_id, keys) == 0


def disk_events(tier: CpuTier) -> list[tuple[str, int]]:
    batches = tier.store.read_events(1, timeout=0)  # type: ignore[attr-defined]
    return [(ev.kind.value, len(ev.keys)) for b in batches for ev in b.events if ev.tier == "disk"]


def test_the_index_hears_of_disk_chunks_from_events_and_snapshots(open_store):
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys = keys_of(3)
    tier.put(ns_id, keys, chunks(3, seed=11))
    disk_of(tier).spill_once()
    assert disk_events(tier) == [("stored", 3)]
    tier.delete(ns_id, keys)
    snap = tier.store.snapshot()  # type: ignore[attr-defined]
    assert snap.chunks == {} and snap.disk_chunks == {ns_id: keys}
    damage_flip_data(chunk_path(disk_of(tier).root, ns_id, keys[0]))
    tier.stage_from_disk(ns_id, keys, timeout_s=5)
    assert disk_events(tier)[-1] == ("removed", 1)
    tier.store.clear()  # type: ignore[attr-defined]
    assert tier.store.snapshot().disk_chunks == {}  # type: ignore[attr-defined]
    assert not [p for p in disk_of(tier).root.rglob("*") if p.is_file() and p.name != ".lock"]


def test_a_disk_smaller_than_the_pool_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must be at least store\.pool\.capacity"):
        config(tmp_path, capacity=CHUNK)


def test_a_store_without_the_disk_tier_says_so(tmp_path):
    plain = StoreConfig.model_validate({"run_dir": str(tmp_path / "run")})
    tier = connect(plain)
    try:
        ns_id = tier.namespace_id(namespace(), CHUNK)
        with pytest.raises(KvtierError) as err:
            tier.stage_from_disk(ns_id, keys_of(1), timeout_s=1)
        assert err.value.code is ErrorCode.UNAVAILABLE and "disk tier" in err.value.message
    finally:
        tier.close()


def test_a_header_that_lies_is_refused():
    header = files.ChunkHeader(b"n" * 16, b"k" * 16, 10, 123)
    raw = bytearray(files.encode_header(header))
    assert files.decode_header(bytes(raw)) == header
    raw[-1] = 1  # padding does not count
    raw[len(files.MAGIC) + 8] ^= 1  # the size field
    with pytest.raises(BadChunkFile):
        files.decode_header(bytes(raw))


def test_the_connectors_disk_tier_skips_runs_measured_no_faster_than_recompute(open_store):
    """With a measured table (disk saves nothing below ~1k tokens here), a short run is not
    staged at all and a long one is; without a table every run is."""
    from kvtier.core.costs import KappaTable
    from kvtier.tiers.base import StageStatus
    from kvtier.tiers.disk import DiskTier

    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    keys = keys_of(4)
    tier.put(ns_id, keys, chunks(4, seed=12))
    disk_of(tier).spill_once()
    tier.delete(ns_id, keys)
    costs = KappaTable({"disk": {512: 0.0, 1024: 0.5}})
    measured = DiskTier(tier, timeout_s=5, costs=costs, chunk_tokens=256)
    short = measured.stage(ns_id, keys[:2], min_chunks=1)  # 512 tokens
    assert (short.status, short.detail) == (StageStatus.NOT_HELD, "slower than recompute")
    assert tier.prefix_length(ns_id, keys) == 0
    long = measured.stage(ns_id, keys, min_chunks=1)  # 1024 tokens
    assert (long.status, long.chunks) == (StageStatus.STAGED, 4)
    tier.delete(ns_id, keys)
    unmeasured = DiskTier(tier, timeout_s=5, costs=KappaTable(), chunk_tokens=256)
    assert unmeasured.stage(ns_id, keys[:2], min_chunks=1).status is StageStatus.STAGED


def test_a_chunk_in_more_pieces_than_one_call_takes(tmp_path):
    """A fragmented pool hands a chunk out in many extents: more than IOV_MAX buffers are
    written and read back in several calls, byte for byte."""
    pieces = [np.full(64, i % 251, dtype=np.uint8) for i in range(files.IOV_MAX * 2 + 7)]
    data = np.concatenate(pieces)
    checksum = checksum_views([data])
    header = files.ChunkHeader(b"n" * 16, b"k" * 16, data.nbytes, checksum)
    path = tmp_path / "chunk"
    files.write_chunk(path, header, pieces)
    into = [np.zeros(64, dtype=np.uint8) for _ in pieces]
    assert files.read_chunk_into(path, header, into) == checksum
    assert np.array_equal(np.concatenate(into), data)


def test_eviction_takes_a_chunk_on_disk_before_a_colder_one_without(open_store):
    """Write-back runs behind a pool that turns over fast: eviction takes copied chunks
    first, so the ones not copied yet stay until they are."""
    tier = open_store(write_through=True)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    copied, fresh = keys_of(4), keys_of(4, start=4)
    copied_data = chunks(4, seed=13)
    tier.put(ns_id, copied, copied_data)
    disk_of(tier).spill_once()  # the first four are on disk; the next four will not be
    tier.put(ns_id, fresh, chunks(4, seed=14))
    assert tier.prefix_length(ns_id, copied) == 4  # a use: the copied ones are hotter now
    tier.put(ns_id, keys_of(2, start=8), chunks(2, seed=15))  # evicts two
    assert tier.prefix_length(ns_id, fresh) == 4  # the coldest, uncopied: kept
    assert tier.prefix_length(ns_id, copied) == 0  # copied ones went instead
    assert tier.store.stats()["dirty_evictions"] == 0  # type: ignore[attr-defined]
    assert tier.stage_from_disk(ns_id, copied, timeout_s=5).local == 4
    assert read_back(tier, ns_id, copied) == copied_data


def test_a_round_pins_at_most_its_share_of_the_pool_and_one_chunk_at_least(open_store):
    """A spill round pins what it copies: in a pool a few batches large, max_batch_bytes
    alone would pin most of it and leave saves no room. Rounds keep going until all is
    copied."""
    tier = open_store(write_through=True, max_pool_share=0.25)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    tier.put(ns_id, keys_of(6), chunks(6, seed=4))
    rounds = []
    while chunks_copied := disk_of(tier).spill_once().chunks:
        rounds.append(chunks_copied)
    assert rounds == [2, 2, 2]  # a quarter of an 8-chunk pool a round


def test_a_round_copies_one_chunk_when_its_share_is_smaller(open_store):
    tier = open_store(write_through=True, max_pool_share=0.01)
    ns_id = tier.namespace_id(namespace(), CHUNK)
    tier.put(ns_id, keys_of(2), chunks(2, seed=5))
    assert disk_of(tier).spill_once().chunks == 1
