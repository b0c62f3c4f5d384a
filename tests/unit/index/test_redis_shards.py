"""How the Redis Cluster index places its shards (``index/backends/redis_shard.py``): the
hash tags are part of what is stored, so they are pinned here."""

from __future__ import annotations

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

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
