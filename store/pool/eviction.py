"""Eviction policies for the DRAM pool.

A policy only orders committed chunks; the store decides what may be evicted (never a pinned or
half-written chunk) and passes that test to ``evict``. Policies weigh chunks by their size in
pages, so one pool can hold chunks of several sizes.

Threading: not thread-safe; the store calls every method under its lock.
Ownership: the policy holds keys only, never chunk data or metadata.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

Key = Hashable  # a chunk key in the store; a block id in the trace simulator
IsEvictable = Callable[[Key], bool]


class EvictionPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def insert(self, key: Key, pages: int) -> None:
        """A chunk was committed. ``key`` is not in the policy."""

    @abc.abstractmethod
    def touch(self, key: Key) -> None:
        """A committed chunk was hit by a lookup."""

    @abc.abstractmethod
    def remove(self, key: Key) -> None:
        """A chunk left the pool for a reason other than ``evict`` (delete, clear)."""

    @abc.abstractmethod
    def evict(self, evictable: IsEvictable) -> Key | None:
        """Choose a victim among chunks for which ``evictable(key)``, forget it, return it.

        Returns None when no tracked chunk is evictable. Non-evictable chunks keep (LRU) or
        regain (FIFO rotation) their standing; they are never returned.
        """

    @abc.abstractmethod
    def coldest(self, evictable: IsEvictable) -> Iterator[Key]:
        """Evictable keys, most likely victims first, without changing anything (demotion
        picks what to move to a peer before eviction would drop it)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: Key) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity_pages: int) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()  # oldest first

    def insert(self, key: Key, pages: int) -> None:
        self._order[key] = pages

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, evictable: IsEvictable) -> Key | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def coldest(self, evictable: IsEvictable) -> Iterator[Key]:
        return (key for key in list(self._order) if evictable(key))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO, a ghost list.

    New chunks enter the small queue (10 % of capacity). A chunk that is hit again while there
    is promoted to the main queue when the small queue is trimmed; one that is not is evicted
    and remembered in the ghost list, so that a quick re-insert goes straight to main. The main
    queue gives each chunk as many second chances as it had hits (up to 3). One-shot prompts
    thus pass through the small queue without displacing the multi-turn working set in main,
    which is what LRU gets wrong on agentic traffic.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity_pages: int, small_ratio: float = 0.1) -> None:
        self._small_cap = max(1, int(capacity_pages * small_ratio))
        self._ghost_cap = max(1, capacity_pages - self._small_cap)
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> pages, oldest first
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_pages = 0
        self._ghost_pages = 0

    def insert(self, key: Key, pages: int) -> None:
        self._freq[key] = 0
        ghost_pages = self._ghost.pop(key, None)
        if ghost_pages is not None:
            self._ghost_pages -= ghost_pages
            self._main[key] = pages
        else:
            self._small[key] = pages
            self._small_pages += pages

    def touch(self, key: Key) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        pages = self._small.pop(key, None)
        if pages is not None:
            self._small_pages -= pages
        else:
            self._main.pop(key, None)

    def evict(self, evictable: IsEvictable) -> Key | None:
        # Every chunk can be looked at a bounded number of times (its frequency drains to 0 in
        # main, promotion happens once), so this loop ends even when nothing is evictable.
        budget = (len(self._small) + len(self._main)) * (self.MAX_FREQ + 2) + 1
        while budget > 0 and (self._small or self._main):
            budget -= 1
            if self._small and (self._small_pages >= self._small_cap or not self._main):
                victim = self._evict_small(evictable)
            else:
                victim = self._evict_main(evictable)
            if victim is not None:
                return victim
        return None

    def _evict_small(self, evictable: IsEvictable) -> Key | None:
        key, pages = self._small.popitem(last=False)
        self._small_pages -= pages
        if self._freq[key] > 0:  # hit while on probation: promote
            self._freq[key] = 0
            self._main[key] = pages
            return None
        if not evictable(key):
            self._small[key] = pages  # rotate; try again later
            self._small_pages += pages
            return None
        del self._freq[key]
        self._ghost[key] = pages
        self._ghost_pages += pages
        while self._ghost_pages > self._ghost_cap:
            _, old = self._ghost.popitem(last=False)
            self._ghost_pages -= old
        return key

    def _evict_main(self, evictable: IsEvictable) -> Key | None:
        key, pages = self._main.popitem(last=False)
        freq = self._freq[key]
        if freq > 0 or not evictable(key):
            self._freq[key] = max(0, freq - 1)
            self._main[key] = pages
            return None
        del self._freq[key]
        return key

    def coldest(self, evictable: IsEvictable) -> Iterator[Key]:
        # The order evict() would follow, approximately: unhit chunks on probation, then unhit
        # chunks in main, then the rest by queue order.
        small, main = list(self._small), list(self._main)
        for key in small + main:
            if self._freq.get(key) == 0 and evictable(key):
                yield key
        for key in small + main:
            if self._freq.get(key, 0) > 0 and evictable(key):
                yield key

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str, capacity_pages: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity_pages)
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
