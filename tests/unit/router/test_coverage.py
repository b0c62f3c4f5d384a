"""What a candidate can read of a prompt, from one index answer (router/core.py ``_Runs``):
its own GPU run, its node's DRAM run, the best run in any other node's pool, and its node's
disk run (another node's disk is not read: only pools are pulled from)."""

from __future__ import annotations

from kvtier.core.chunks import Tier
from kvtier.index.api import Holding, LocationKind, QueryResult
from kvtier.router.backends import Backend
from kvtier.router.core import _Runs

INSTANCE, NODE = LocationKind.INSTANCE, LocationKind.NODE


def _holding(location: str, kind: LocationKind, **runs: int) -> Holding:
    by_tier = {Tier(t): n for t, n in runs.items()}
    return Holding(location, kind, "", by_tier, max(by_tier.values()), 0.0, 0.0)


def test_own_gpu_own_node_and_the_best_other_node() -> None:
    result = QueryResult(
        b"n" * 16,
        20,
        (
            _holding("n-far", NODE, cpu=12),
            _holding("n-own", NODE, cpu=16),
            _holding("i0", INSTANCE, gpu=3, cpu=4),
            _holding("n-near", NODE, cpu=9),
        ),
    )
    runs = _Runs(result)
    assert runs.of(Backend("i0", "u", node="n-own")) == (3, 16, 12, 0)  # own node is the best
    assert runs.of(Backend("i1", "u", node="n-far")) == (0, 12, 16, 0)
    assert runs.of(Backend("i2", "u")) == (0, 0, 16, 0)  # node unknown: every pool is remote
    assert runs.of(Backend("i0", "u", node="n-x")) == (3, 4, 16, 0)  # its own offload in DRAM


def test_the_nodes_disk_run_is_its_own_not_another_nodes() -> None:
    result = QueryResult(
        b"n" * 16,
        20,
        (
            _holding("n-own", NODE, cpu=2, disk=18),
            _holding("n-far", NODE, cpu=5, disk=20),
        ),
    )
    runs = _Runs(result)
    assert runs.of(Backend("i0", "u", node="n-own")) == (0, 2, 5, 18)
    assert runs.of(Backend("i1", "u", node="n-far")) == (0, 5, 2, 20)
