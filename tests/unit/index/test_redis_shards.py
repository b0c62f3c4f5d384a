"""How the Redis Cluster index places its shards (``index/backends/redis_shard.py``): the
hash tags are part of what is stored, so they are pinned here; and how placement by chunk
joins a prompt's answer from its shards' (``combine_answers``)."""

from __future__ import annotations

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvtier.core.chunks import Tier
from kvtier.index.api import Holding, IndexHealth, LocationKind, QueryResult
from kvtier.index.backends.redis_cluster import combine_answers
from kvtier.index.backends.redis_shard import shard_tags

# Changing these orphans every index already in a cluster (another process would look for
# its chunks under other keys): a new placement needs a new prefix or a migration.
PINNED = {
    1: ["s0.0"],
    3: ["s0.0", "s1.1", "s2.1"],
    6: ["s0.10", "s1.12", "s2.13", "s3.3", "s4.2", "s5.9"],
}


def test_tags_are_pinned() -> None:
    for count, tags in PINNED.items():
        assert shard_tags(count) == tags


def test_each_shard_lands_in_its_own_equal_slot_range() -> None:
    for count in (1, 2, 3, 6, 16, 64):
        span = REDIS_CLUSTER_HASH_SLOTS / count
        for i, tag in enumerate(shard_tags(count)):
            # the full key carries the tag in braces: only the tag is hashed
            slot = key_slot(f"kvtier:index:{{{tag}}}:c:x".encode())
            assert slot == key_slot(tag.encode())
            assert int(i * span) <= slot < int((i + 1) * span)


def test_three_equal_masters_get_equal_shares_of_six() -> None:
    masters = [0] * 3
    for tag in shard_tags(6):
        masters[key_slot(tag.encode()) * 3 // REDIS_CLUSTER_HASH_SLOTS] += 1
    assert masters == [2, 2, 2]


# -- placement by chunk: one prompt's answer from its shards' (combine_answers) ---------------


def _held(location: str, total: int, stored_at: float = 1.0, **runs: int) -> Holding:
    tiers = {Tier(name): n for name, n in runs.items()}
    return Holding(location, LocationKind.INSTANCE, "n0", tiers, total, 5.0, stored_at)


def _answer(*holdings: Holding, health: IndexHealth = IndexHealth.OK) -> QueryResult:
    return QueryResult(b"ns", 0, holdings, health)


def test_a_run_ends_at_the_first_chunk_any_shard_lacks() -> None:
    # a 6-chunk prompt: shard A was asked about chunks 0, 2, 3 and shard B about 1, 4, 5
    a, b = [0, 2, 3], [1, 4, 5]
    combined = combine_answers(
        b"ns",
        6,
        [
            (a, _answer(_held("i0", 3, gpu=3), _held("i1", 1, cpu=1))),  # i1 lacks chunk 2
            (b, _answer(_held("i0", 2, gpu=1, cpu=2, stored_at=7.0), _held("i1", 3, cpu=3))),
        ],
    )
    i0, i1 = combined.of("i0"), combined.of("i1")
    assert i0 is not None and i1 is not None
    # i0: A holds all of its chunks, B lacks chunk 5 (its third): the run is 5 chunks. In GPU
    # it is 4 (B's GPU run ends before chunk 4); in CPU 0 (A holds chunk 0 in GPU only)
    assert (i0.total, dict(i0.runs)) == (5, {Tier.GPU: 4})
    assert (i1.total, dict(i1.runs)) == (2, {Tier.CPU: 2})  # A lacks chunk 2
    assert i0.stored_at == 7.0  # the newest of the shards' (a hint, not a place)
    assert [h.location for h in combined.holdings] == ["i0", "i1"]  # longest first


def test_a_location_one_shard_does_not_name_lacks_that_shards_first_chunk() -> None:
    combined = combine_answers(
        b"ns", 4, [([0, 1], _answer(_held("i0", 2, gpu=2))), ([2, 3], _answer())]
    )
    assert combined.of("i0").total == 2  # type: ignore[union-attr]
    # and a run that ends before a shard's first chunk is not cut further by that shard
    combined = combine_answers(
        b"ns", 4, [([1, 2, 3], _answer()), ([0], _answer(_held("i0", 1, gpu=1)))]
    )
    assert combined.of("i0").total == 1  # type: ignore[union-attr]


def test_a_shard_not_answering_degrades_the_whole_answer() -> None:
    combined = combine_answers(
        b"ns",
        4,
        [
            ([0, 2], _answer(_held("i0", 2, gpu=2))),
            ([1, 3], _answer(health=IndexHealth.DEGRADED)),
        ],
    )
    assert combined.health is IndexHealth.DEGRADED and combined.holdings == ()
    assert combined.num_chunks == 4
