"""Bounds on one request and one tenant, and crash hygiene that trusts nothing planted.

- A batch over ``store.max_batch_keys`` is refused before the store's lock is taken; an
  allocate asking for more than ``store.max_batch_fraction`` of a pool it does not fit in the
  free space of is refused whole and evicts nothing (a 2 M-key allocate once did both).
- Namespaces and a lease's whole life (renewals included) are bounded.
- Tenants (told apart by their cache_salt) hold at most their quota, evicting their own
  coldest chunks first, and keep their floor against other tenants' allocations; stats and
  metrics name them, never their salts.
- A restarting store removes only its own kind of segment, named by its own lock files in a
  private run_dir: a planted lock file cannot make it delete anything else.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys, salt_digest
from kvtier.store.api.types import AllocStatus, LeaseStatus
from kvtier.store.client.shm import SHM_DIR
from kvtier.store.node import NodeStore
from kvtier.store.run_dir import cleanup_stale_segments
from kvtier.store.server.metrics import StoreCollector
from kvtier.store.state.core import StoreCore
from kvtier.store.state.limits import StoreLimits
from kvtier.store.state.quotas import TenantLimits

PAGE = 4096
SALTS = {"a": "salt-of-tenant-a", "b": "salt-of-tenant-b"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(pages: int = 32, clock: FakeClock | None = None, **limits: object) -> StoreCore:
    return StoreCore(
        node_id="n",
        epoch=1,
        capacity_bytes=pages * PAGE,
        page_size=PAGE,
        eviction="lru",
        lease_ttl_s=30,
        write_ttl_s=30,
        clock=clock or FakeClock(),
        limits=StoreLimits(**limits),  # type: ignore[arg-type]
    )


def namespace(tenant: str | None = None, model: str = "m") -> Namespace:
    salt = salt_digest(SALTS[tenant]) if tenant else ""
    return Namespace(
        model=model, dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4,
        cache_salt=salt,
    )  # fmt: skip


def keys(ns: Namespace, n: int, start: int = 0) -> list[bytes]:
    return prompt_keys(ns, list(range(4 * start, 4 * (start + n))))


def put(core: StoreCore, ns_id: bytes, ks: list[bytes]) -> list[AllocStatus]:
    result = core.allocate(ns_id, ks, [PAGE] * len(ks))
    if result.lease_id:
        n = result.statuses.count(AllocStatus.ALLOCATED)
        core.commit(result.lease_id, None, [1] * n)
    return result.statuses


def held(core: StoreCore, ns_id: bytes, ks: list[bytes]) -> list[bool]:
    return core.committed_mask(ns_id, ks)


# -- batch caps ---------------------------------------------------------------------------


def test_batch_over_max_keys_is_refused_before_the_lock() -> None:
    core = make_core(max_batch_keys=8)
    ns = namespace()
    ns_id = core.register_namespace(ns, PAGE)
    ks = keys(ns, 9)
    lease = core.allocate(ns_id, ks[:2], [PAGE] * 2).lease_id
    calls = {
        "lookup": lambda: core.lookup(ns_id, ks, 5),
        "allocate": lambda: core.allocate(ns_id, ks, [PAGE] * 9),
        "commit": lambda: core.commit(lease, ks, [1] * 9),
        "abort": lambda: core.abort(lease, ks),
        "delete": lambda: core.delete(ns_id, ks),
        "committed_mask": lambda: core.committed_mask(ns_id, ks),
    }
    # Another thread holds the store's lock: a refused batch must not even wait for it.
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with core._lock:
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    locked.wait(5)
    try:
        for name, call in calls.items():
            with pytest.raises(KvtierError) as err:
                call()
            assert err.value.code is ErrorCode.INVALID_ARGUMENT, name
            assert err.value.message == "batch of 9 keys exceeds store.max_batch_keys = 8", name
        with pytest.raises(KvtierError) as err:
            core.release(list(range(1, 10)))
        assert err.value.message == "batch of 9 lease ids exceeds store.max_batch_keys = 8"
    finally:
        release.set()
        holder.join()
    assert core.stats()["lookups"] == 0  # nothing ran
    assert core.abort(lease) == 2  # the lease is intact
    core.check_invariants()


def test_allocate_over_batch_fraction_evicts_nothing() -> None:
    core = make_core(pages=32, max_batch_fraction=0.25)  # 8 pages at once, once the pool is full
    ns = namespace()
    ns_id = core.register_namespace(ns, PAGE)
    # An empty pool: a batch over the fraction that fits in free space takes nobody's chunks.
    old = keys(ns, 32)
    assert put(core, ns_id, old) == [AllocStatus.ALLOCATED] * 32
    # Full: 9 pages would evict more than a quarter of the pool in one call.
    with pytest.raises(KvtierError) as err:
        core.allocate(ns_id, keys(ns, 9, start=100), [PAGE] * 9)
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    assert "store.max_batch_fraction = 0.25" in err.value.message
    assert "allocate at most 32768 bytes at once" in err.value.message
    assert all(held(core, ns_id, old)) and core.stats()["evictions"] == 0
    # Keys already stored ask for nothing: a re-put of the whole pool is fine.
    assert put(core, ns_id, old[:16]) == [AllocStatus.EXISTS] * 16
    # Within the fraction, eviction works as always.
    assert put(core, ns_id, keys(ns, 8, start=100)) == [AllocStatus.ALLOCATED] * 8
    assert core.stats()["evictions"] == 8
    core.check_invariants()


def test_namespace_cap_and_re_registration() -> None:
    core = make_core(max_namespaces=2)
    first = core.register_namespace(namespace(model="one"), PAGE)
    core.register_namespace(namespace(model="two"), PAGE)
    with pytest.raises(KvtierError) as err:
        core.register_namespace(namespace(model="three"), PAGE)
    assert err.value.code is ErrorCode.LIMIT_EXCEEDED
    assert "store.max_namespaces = 2" in err.value.message
    assert core.register_namespace(namespace(model="one"), PAGE) == first  # known: always works
    assert core.stats()["namespaces"] == 2


def test_lease_lifetime_caps_renewals() -> None:
    clock = FakeClock()
    core = make_core(clock=clock, max_lease_lifetime_s=100)
    ns = namespace()
    ns_id = core.register_namespace(ns, PAGE)
    ks = keys(ns, 2)
    put(core, ns_id, ks)
    lease = core.lookup(ns_id, ks, lease_ttl_s=30).lease_id
    clock.now += 25
    assert core.renew(lease, 30) == 30
    clock.now += 25
    assert core.renew(lease, 30) == 30  # t = 50: 30 more still within the 100 s life
    clock.now += 25
    assert core.renew(lease, 30) == pytest.approx(25)  # t = 75: shortened to the lifetime
    clock.now += 25.5
    with pytest.raises(KvtierError) as err:
        core.renew(lease, 30)
    assert err.value.code is ErrorCode.LEASE_EXPIRED
    assert core.release([lease]) == [LeaseStatus.EXPIRED]
    assert core.stats()["pinned_bytes"] == 0
    # A first TTL longer than the lifetime is cut to it too.
    lease = core.lookup(ns_id, ks, lease_ttl_s=500).lease_id
    clock.now += 100
    core.reap()
    assert core.release([lease]) == [LeaseStatus.EXPIRED]
    core.check_invariants()


# -- tenants ------------------------------------------------------------------------------


def tenant_core(pages: int = 16, **limits: object) -> StoreCore:
    tenants = limits.pop("tenants", ())
    return make_core(pages, tenants=tuple(tenants), **limits)  # type: ignore[arg-type]


def limits_of(name: str, quota: int | None = None, floor: int = 0) -> TenantLimits:
    return TenantLimits(name, (salt_digest(SALTS[name]),), quota, floor)


def test_tenant_over_quota_evicts_its_own_oldest_first() -> None:
    core = tenant_core(16, tenants=[limits_of("a", quota=4 * PAGE)])
    ns_a, ns_b = namespace("a"), namespace("b")
    a, b = core.register_namespace(ns_a, PAGE), core.register_namespace(ns_b, PAGE)
    others = keys(ns_b, 4)  # older than all of a's chunks, and b has no quota
    assert put(core, b, others) == [AllocStatus.ALLOCATED] * 4
    first = keys(ns_a, 4)
    assert put(core, a, first) == [AllocStatus.ALLOCATED] * 4
    core.lookup(a, first[2:3])  # a use: first[2] is no longer among a's oldest
    more = keys(ns_a, 2, start=50)
    assert put(core, a, more) == [AllocStatus.ALLOCATED] * 2  # the pool had room: quota did not
    assert held(core, a, first) == [False, False, True, True]  # its two coldest went
    assert all(held(core, b, others))  # another tenant's chunks are never taken for a quota
    stats = core.stats()
    assert stats["tenant_used_bytes.a"] == 4 * PAGE
    assert stats["tenant_quota_bytes.a"] == 4 * PAGE
    assert stats["tenant_used_bytes.other"] == 4 * PAGE  # b is not named: "other"
    assert stats["quota_evictions"] == 2 and stats["evictions"] == 2
    core.check_invariants()


def test_tenant_at_quota_with_nothing_of_its_own_to_evict_gets_no_space() -> None:
    core = tenant_core(16, tenants=[limits_of("a", quota=3 * PAGE)])
    ns_a = namespace("a")
    a = core.register_namespace(ns_a, PAGE)
    first = keys(ns_a, 3)
    put(core, a, first)
    lease = core.lookup(a, first, lease_ttl_s=10).lease_id  # all pinned
    statuses = put(core, a, keys(ns_a, 2, start=50))
    assert statuses == [AllocStatus.NO_SPACE] * 2
    assert all(held(core, a, first)) and core.stats()["evictions"] == 0
    assert core.stats()["quota_no_space"] == 2
    core.release([lease])
    # A batch that only partly fits: its own chunks go for as many as fit, the rest NO_SPACE.
    statuses = put(core, a, keys(ns_a, 5, start=60))
    assert statuses == [AllocStatus.ALLOCATED] * 3 + [AllocStatus.NO_SPACE] * 2
    assert core.stats()["tenant_used_bytes.a"] == 3 * PAGE
    core.check_invariants()


def test_floor_is_never_evicted_for_another_tenant() -> None:
    core = tenant_core(16, tenants=[limits_of("a"), limits_of("b", floor=6 * PAGE)])
    ns_a, ns_b = namespace("a"), namespace("b")
    a, b = core.register_namespace(ns_a, PAGE), core.register_namespace(ns_b, PAGE)
    b_keys = keys(ns_b, 10)
    put(core, b, b_keys)  # b holds 10 pages, 6 of them its floor; b's are the coldest
    a_keys = keys(ns_a, 12)
    statuses = [put(core, a, [k])[0] for k in a_keys]
    assert statuses == [AllocStatus.ALLOCATED] * 12  # past b's floor, a evicts its own
    assert held(core, b, b_keys).count(True) == 6  # evicted down to its floor, not below
    assert held(core, a, a_keys) == [False] * 2 + [True] * 10
    stats = core.stats()
    assert stats["tenant_used_bytes.b"] == 6 * PAGE
    assert stats["tenant_floor_bytes.b"] == 6 * PAGE
    # With a's own chunks pinned, nothing is left that a may take: NO_SPACE, b keeps 6.
    lease = core.lookup(a, a_keys[2:], lease_ttl_s=10).lease_id
    assert put(core, a, keys(ns_a, 1, start=90)) == [AllocStatus.NO_SPACE]
    assert held(core, b, b_keys).count(True) == 6
    # The floor binds only other tenants: b makes room by evicting its own.
    assert put(core, b, keys(ns_b, 1, start=90)) == [AllocStatus.ALLOCATED]
    assert core.stats()["tenant_used_bytes.b"] == 6 * PAGE
    core.release([lease])
    core.check_invariants()


def test_default_quota_caps_each_unlisted_tenant() -> None:
    core = tenant_core(16, default_quota_bytes=2 * PAGE)
    one, two = namespace(), namespace(model="x").model_copy(update={"cache_salt": "f" * 32})
    n1, n2 = core.register_namespace(one, PAGE), core.register_namespace(two, PAGE)
    assert put(core, n1, keys(one, 3)) == [AllocStatus.ALLOCATED] * 2 + [AllocStatus.NO_SPACE]
    assert put(core, n2, keys(two, 2)) == [AllocStatus.ALLOCATED] * 2  # its own cap
    assert core.stats()["tenant_used_bytes.other"] == 4 * PAGE  # summed under one label


def test_tenant_config_maps_raw_salts_and_names_only_reach_stats() -> None:
    config = StoreConfig(
        tenants=[
            {"name": "a", "cache_salts": [SALTS["a"]], "quota": "64KiB", "floor": "8KiB"},
            {"name": "b", "cache_salts": [SALTS["b"]]},
        ],
        default_quota="1MiB",
        max_batch_keys=100,
    )
    limits = StoreLimits.from_config(config)
    assert limits.tenants[0] == TenantLimits("a", (salt_digest(SALTS["a"]),), 64 << 10, 8 << 10)
    assert limits.default_quota_bytes == 1 << 20 and limits.max_batch_keys == 100
    core = make_core(64, **{f: getattr(limits, f) for f in StoreLimits.__slots__})
    ns_id = core.register_namespace(namespace("a"), PAGE)
    put(core, ns_id, keys(namespace("a"), 3))
    stats = core.stats()
    assert stats["tenant_used_bytes.a"] == 3 * PAGE and stats["tenant_used_bytes.b"] == 0
    families = {f.name: f for f in StoreCollector(lambda: stats).collect()}
    used = {s.labels["tenant"]: s.value for s in families["kvtier_store_tenant_used_bytes"].samples}
    assert used == {"a": 3 * PAGE, "b": 0, "other": 0}
    labels = [s.labels for f in families.values() for s in f.samples]
    text = json.dumps(stats) + json.dumps(labels)
    for salt in SALTS.values():
        assert salt not in text and salt_digest(salt) not in text


def test_one_salt_in_two_tenants_is_refused() -> None:
    with pytest.raises(KvtierError) as err:
        tenant_core(tenants=[limits_of("a"), TenantLimits("c", (salt_digest(SALTS["a"]),))])
    assert "'a' and 'c' list the same cache_salt" in err.value.message
    assert SALTS["a"] not in err.value.message


# -- crash hygiene ------------------------------------------------------------------------


@pytest.fixture
def shm_files() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def shm_file(made: list[Path], name: str) -> Path:
    path = SHM_DIR / name
    path.write_bytes(b"precious")
    made.append(path)
    return path


def test_planted_lock_files_delete_nothing_else(
    run_dir: Path, tmp_path: Path, shm_files: list[Path]
) -> None:
    tag = uuid.uuid4().hex[:8]
    victim = shm_file(shm_files, f"victim-{tag}")
    other_store = shm_file(shm_files, f"kvtier-someone-else-{tag}-{'a' * 16}")
    outside = tmp_path / "outside"
    outside.write_text(f"victim-{tag}")
    stale = shm_file(shm_files, f"kvtier-crashed-{tag}-{'0' * 16}")
    planted = {
        "bare.lock": f"victim-{tag}",
        "absolute.lock": str(victim),
        "dotdot.lock": f"../shm/victim-{tag}",
        "dotdot2.lock": "../x",
        "another-store.lock": other_store.name,  # the pattern, but not this lock file's store
        f"crashed-{tag}.lock": stale.name,  # a genuine leftover: still cleaned up
    }
    for name, content in planted.items():
        (run_dir / name).write_text(content)
    (run_dir / "link.lock").symlink_to(outside)  # a symlink: never followed
    os.mkfifo(run_dir / "fifo.lock")

    removed = cleanup_stale_segments(run_dir)

    assert removed == [stale.name] and not stale.exists()
    assert victim.read_bytes() == b"precious"
    assert other_store.read_bytes() == b"precious"
    assert outside.read_text() == f"victim-{tag}"
    assert (run_dir / "link.lock").is_symlink()  # not ours to remove


def test_store_start_ignores_planted_lock_and_refuses_a_symlinked_one(
    run_dir: Path, tmp_path: Path, shm_files: list[Path]
) -> None:
    tag = uuid.uuid4().hex[:8]
    victim = shm_file(shm_files, f"victim-{tag}")
    (run_dir / "planted.lock").write_text(str(victim))
    config = StoreConfig(node_id=f"n{tag}", run_dir=run_dir, pool={"capacity": 1 << 20})
    NodeStore(config, instance="i").close()
    assert victim.exists()
    # The store's own lock file planted as a symlink: refused, its target left untouched.
    target = tmp_path / "target"
    target.write_text("keep me")
    (run_dir / f"n{tag}-i.lock").symlink_to(target)
    with pytest.raises(KvtierError) as err:
        NodeStore(config, instance="i")
    assert "cannot open lock file" in err.value.message
    assert target.read_text() == "keep me"


def test_run_dir_must_be_private(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(KvtierError) as err:
        NodeStore(StoreConfig(run_dir=loose, pool={"capacity": 1 << 20}))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "writable by group or others (mode 0777)" in err.value.message
    assert "chmod 700" in err.value.message
    fresh = tmp_path / "a" / "b" / "run"
    NodeStore(StoreConfig(run_dir=fresh, pool={"capacity": 1 << 20})).close()
    assert stat.S_IMODE(fresh.stat().st_mode) & 0o077 == 0  # created private


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another uid")
def test_run_dir_of_another_uid_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(KvtierError) as err:
        NodeStore(StoreConfig(run_dir=foreign, pool={"capacity": 1 << 20}))
    assert "is owned by uid 65534" in err.value.message


def test_default_run_dir_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert StoreConfig().run_dir == tmp_path / "xdg" / "kvtier"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert StoreConfig().run_dir == tmp_path / "home" / ".cache" / "kvtier" / "run"
