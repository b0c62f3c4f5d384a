"""Remote tier pieces that need no second process: op planning, configuration, the engine's
environment (a store that runs without the transfer engine, in a fresh interpreter:
tests/integration/test_remote_optional.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvtier.core.config import StoreConfig, load_config
from kvtier.core.config.store import RemoteConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.node import NodeStore
from kvtier.store.remote.demotion import Demoter
from kvtier.store.remote.mooncake import engine_environment
from kvtier.store.remote.peers import PeerClients
from kvtier.store.remote.transport import RangeError, plan_ops, split_ops
from kvtier.store.state.core import StoreCore


def _cut(total: int, cuts: list[int], base: int, gap: int) -> list[tuple[int, int]]:
    """``total`` bytes as extents cut at ``cuts``, laid out from ``base`` with holes."""
    points = sorted({c for c in cuts if 0 < c < total})
    bounds = [0, *points, total]
    extents, pos = [], base
    for a, b in itertools.pairwise(bounds):
        extents.append((pos, b - a))
        pos += b - a + gap
    return extents


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 5000),
    lcuts=st.lists(st.integers(1, 4999), max_size=6),
    rcuts=st.lists(st.integers(1, 4999), max_size=6),
    lbase=st.integers(0, 100),
    rbase=st.integers(0, 100),
    gap=st.integers(0, 3),
    max_op=st.integers(1, 6000),
)
def test_plan_ops_maps_every_byte_once_in_order(
    total, lcuts, rcuts, lbase, rbase, gap, max_op
) -> None:
    local = _cut(total, lcuts, lbase, gap)
    remote = _cut(total, rcuts, rbase, gap)
    size = 100 + 2 * total + 30
    ops = plan_ops(local, remote, size, size)
    # Expand both sides to per-byte addresses: op bytes must pair them up exactly, in order.
    lbytes = [off + i for off, n in local for i in range(n)]
    rbytes = [off + i for off, n in remote for i in range(n)]
    pairs = [(op.local_offset + i, op.remote_offset + i) for op in ops for i in range(op.length)]
    assert pairs == list(zip(lbytes, rbytes, strict=True))
    assert len(ops) <= len(local) + len(remote) - 1  # the common refinement, no more
    split = split_ops(ops, max_op)  # cut to size: same bytes, same order
    assert all(0 < op.length <= max_op for op in split)
    assert [(o.local_offset + i, o.remote_offset + i) for o in split for i in range(o.length)] == (
        pairs
    )


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([(0, 10)], [(95, 10)], "remote range"),  # past the peer's end
        ([(-1, 10)], [(0, 10)], "local range"),
        ([(0, 10)], [(0, 9)], "sizes differ"),
        ([(0, 0)], [(0, 0)], "local range"),  # empty extents are refused
    ],
)
def test_plan_ops_refuses_ranges_outside_a_pool(local, remote, match) -> None:
    with pytest.raises(RangeError, match=match):
        plan_ops(local, remote, 100, 100)


def test_engine_environment_follows_the_config() -> None:
    env = engine_environment(
        RemoteConfig(transfer_timeout_s=7, tcp_progress_timeout_s=2, min_port=20000, max_port=20100)
    )
    assert env["MC_FORCE_TCP"] == "1"
    assert env["MC_TRANSFER_TIMEOUT"] == "7"
    assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == env["MC_TCP_STATUS_TIMEOUT_SEC"] == "2"
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("20000", "20100")
    assert env["MC_LOG_LEVEL"] == "ERROR"
    assert engine_environment(RemoteConfig(protocol="rdma"))["MC_FORCE_TCP"] is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tcp_progress_timeout_s": 5, "transfer_timeout_s": 5}, "tcp_progress_timeout_s"),
        ({"transfer_timeout_s": 4}, "transfer_timeout_s"),
        ({"quarantine_s": 5}, "quarantine_s"),
        ({"metadata": "redis://127.0.0.1:6379"}, "metadata"),
        ({"min_port": 17000, "max_port": 16000}, "min_port"),
        ({"enabled": True, "demotion": {"policy": "peers"}}, "peers"),
        ({"demotion": {"high_watermark": 0.5, "low_watermark": 0.6}}, "low_watermark"),
    ],
)
def test_bad_remote_config_is_a_clear_error(fields: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        RemoteConfig(**fields)


def test_remote_section_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    monkeypatch.setenv("KVTIER_STORE__REMOTE__ENABLED", "true")
    monkeypatch.setenv("KVTIER_STORE__REMOTE__FETCH_TIMEOUT_S", "0.5")
    config = load_config(**{"store.remote.peers": ["10.0.0.2:50551"]})
    assert config.store.remote.enabled and config.store.remote.fetch_timeout_s == 0.5
    assert config.store.remote.peers == ["10.0.0.2:50551"]
    assert config.store.remote.metadata == "P2PHANDSHAKE"


def test_store_without_remote_tier_says_unavailable(store_config: StoreConfig) -> None:
    ns = Namespace(model="m", dtype="f16", num_layers=1, num_kv_heads=1, head_size=8)
    node = NodeStore(store_config)
    try:
        ns_id = node.register_namespace(ns, 4096)
        assert node.info().transfer_address == "" and node.info().transfer_base == 0
        for call in (
            lambda: node.fetch(ns_id, [b"k" * 16], "127.0.0.1:1"),
            lambda: node.lease_for_peer(ns_id, [b"k" * 16]),
        ):
            with pytest.raises(KvtierError) as err:
                call()
            assert err.value.code is ErrorCode.UNAVAILABLE
        assert "remote_fetches" not in node.stats()
    finally:
        node.close()


def test_demotion_counts_chunks_that_free_themselves_as_free() -> None:
    """A chunk deleted under a reader's lease (the peer's lease on what it just pulled) still
    has its pages until the lease ends; the demoter must not see it as fill to move, or the
    round after a move moves the rest of the pool (seen on CI: every chunk demoted)."""
    page, chunk = 4096, 4 * 4096
    core = StoreCore(
        node_id="n", epoch=1, capacity_bytes=16 * chunk, page_size=page, eviction="lru",
        lease_ttl_s=30, write_ttl_s=30, event_buffer=64,
    )  # fmt: skip
    ns = Namespace(model="m", dtype="f16", num_layers=1, num_kv_heads=1, head_size=8)
    ns_id = core.register_namespace(ns, chunk)
    keys = prompt_keys(ns, list(range(12 * ns.chunk_tokens)))
    alloc = core.allocate(ns_id, keys, [chunk] * 12)
    core.commit(alloc.lease_id, None, list(range(1, 13)))
    demotion = {"high_watermark": 0.5, "low_watermark": 0.25}
    demoter = Demoter(core, RemoteConfig(demotion=demotion), PeerClients(1.0), "self:1")
    assert demoter.over_watermark() == 8 * chunk  # 12 of 16 held: back down to 4

    lease = core.lookup(ns_id, keys[:8], lease_ttl_s=30)  # the peer pulls the 8 coldest...
    core.delete(ns_id, keys[:8])  # ...and they are deleted here before it releases them
    assert core.stats()["used_bytes"] == 12 * chunk and core.stats()["doomed_bytes"] == 8 * chunk
    assert demoter.over_watermark() == 0
    assert core.upkeep.coldest(16 * chunk) == [(ns_id, k, chunk) for k in keys[8:]]  # still held
    core.release([lease.lease_id])
    assert core.stats()["used_bytes"] == 4 * chunk and demoter.over_watermark() == 0
