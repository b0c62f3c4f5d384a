"""A run a staging tier brings into the pool is verified like the pool's own.

With ``verify_loads`` the pool's run ends before a chunk the store has not checksummed yet
(committed moments ago; the store sums it off the writer's path). A staging tier asked for
the rest finds that same chunk already in the pool and reports it staged: the connector must
cut the staged run the same way, or it loads the unverified chunk it just refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.lookup import TierResolver
from kvtier.connector.request_state import RequestState
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.tiers import Tiers, connect
from kvtier.tiers.base import StageResult, StageStatus, StagingTier

CHUNK = 64
GEOMETRY = KvGeometry(("l0",), 32, 1024, CHUNK, "t")
IDENTITY = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_size=1)


class FoundInPool(StagingTier):
    """A tier whose holder is this very node: every chunk asked is already committed here."""

    name = "remote"

    def stage(self, ns_id: bytes, keys: Sequence[bytes], min_chunks: int) -> StageResult:
        return StageResult(StageStatus.STAGED, chunks=len(keys))


def test_staged_run_stops_at_chunks_without_a_checksum(store_config: StoreConfig) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    pool = connect(store_config)
    pool.store.core.upkeep.take_unsummed = lambda limit=64: []  # the checksummer is behind
    config = ConnectorConfig(
        chunk_tokens=CHUNK, tiers=["cpu", "remote"], min_hit_tokens={"cpu": 0, "remote": 0}
    )
    resolver = TierResolver(
        config, GEOMETRY, lambda: IDENTITY, Tiers(pool, [FoundInPool()]), lambda c, v: None
    )
    try:
        tokens = list(range(4, 4 + 4 * CHUNK + 1))
        state = RequestState.of(Request("r", tokens, SamplingParams(max_tokens=1), None), 0)
        ns_id = resolver.namespaces(state)[0]
        keys = state.keys(0, 4, CHUNK)
        page = np.zeros(GEOMETRY.chunk_bytes, dtype=np.uint8)
        pool.put(ns_id, keys, [page] * 4)  # committed, not checksummed yet
        outcome = resolver.resolve(state, 0)
        assert outcome.tokens == 0  # nothing verifiable: recompute
        assert outcome.hits[0] == []
    finally:
        pool.close()
