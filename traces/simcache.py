"""A block cache with the node store's exact semantics, for simulation.

``BlockCache`` replays what ``kvtier.store.state.core.StoreCore`` does for a request, with every
chunk one page and no leases, using the store's own policy objects (``make_policy``):

- ``lookup(keys)``: the longest run of leading keys held; each hit is touched
  (``StoreCore.lookup``);
- ``store(keys)``: a key already held is touched (allocate's EXISTS); a missing one gets a page,
  evicting the policy's victim while no page is free, and is inserted into the policy only after
  the whole batch is placed (allocate, then commit). Keys being written cannot be evicted, so a
  batch larger than the cache stores what fits and drops the rest (NO_SPACE).

tests/unit/traces/test_simulate.py drives a real StoreCore and a BlockCache with the same operations
and checks that they hit and keep the same keys.

Threading: not thread-safe. Keys are any hashable (trace hash ids here).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtier.store.pool.eviction import EvictionPolicy, make_policy

Key = Hashable


def _always(_key: Key) -> bool:
    return True


class BlockCache:
    def __init__(self, capacity_blocks: int, policy: str = "lru") -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity_blocks
        self.policy_name = policy
        self._policy: EvictionPolicy = make_policy(policy, max(capacity_blocks, 1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, key: Key) -> bool:
        return key in self._policy

    def match(self, keys: Sequence[Key], start: int = 0) -> int:
        """Leading keys from ``start`` that are held, without touching them."""
        policy = self._policy
        n = 0
        for key in keys[start:] if start else keys:
            if key not in policy:
                break
            n += 1
        return n

    def lookup(self, keys: Sequence[Key], start: int = 0) -> int:
        """``match`` plus a touch of every hit, as a store lookup does."""
        n = self.match(keys, start)
        touch = self._policy.touch
        for key in keys[start : start + n]:
            touch(key)
        return n

    def store(self, keys: Sequence[Key], start: int = 0) -> tuple[list[Key], list[Key]]:
        """Allocate + commit ``keys[start:]``; returns (inserted, evicted)."""
        policy = self._policy
        pending: list[Key] = []
        placed: set[Key] = set()
        evicted: list[Key] = []
        held = len(policy)
        for key in keys[start:] if start else keys:
            if key in policy:
                policy.touch(key)
                continue
            if key in placed:
                continue  # a key twice in one batch is stored once
            if held + len(pending) >= self.capacity:
                if not held:
                    continue  # NO_SPACE: only chunks being written would be left to evict
                victim = policy.evict(_always)
                assert victim is not None
                evicted.append(victim)
                held -= 1
            pending.append(key)
            placed.add(key)
        for key in pending:
            policy.insert(key, 1)
        self.evictions += len(evicted)
        return pending, evicted
