"""A radix tree over a trace's prompts, for prefix-repetition statistics.

Hash ids are prefix hashes, so each id *is* a node of the prompt trie (the prefix ending with
that block) and a request is a root path. The tree is kept as arrays indexed by block slot:
parent, depth, how many requests passed through, how many children, how many requests ended
there. Its radix (path-compressed) nodes are the blocks where the set of requests changes:
a branch point, a leaf, or a block where some request ends. Along one radix edge every block is
shared by exactly the same requests, so a radix node with count c and depth d is one distinct
prefix of d blocks that recurs in c requests; chains of blocks with the same sharers are
counted once, not once per block.

Threading: not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.traces.blocks import BlockIndex

_UNSET = -2  # parent of a block never seen; -1 is the root


@dataclass(frozen=True, slots=True)
class RepetitionRow:
    min_tokens: int
    counts: dict[int, int]  # min recurrences -> distinct prefixes


class PrefixTree:
    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._parent = index.array(np.int64, _UNSET)
        self._depth = index.array(np.int32, 0)
        self._count = index.array(np.int64, 0)
        self._children = index.array(np.int32, 0)
        self._ends = index.array(np.int32, 0)
        self.root_children = 0
        self.distinct = 0  # blocks in the tree
        self.inconsistent = 0  # blocks met under another parent than before (bad hash ids)

    def known_prefix(self, slots: np.ndarray) -> int:
        """How many leading blocks of ``slots`` the tree already holds (an infinite cache hit)."""
        n = len(slots)
        if not n:
            return 0
        known = self._parent.data[slots] != _UNSET
        return n if known.all() else int(np.argmin(known))

    def depth(self, slot: int) -> int:
        return int(self._depth.data[slot])

    def common_prefix(self, node: int, slots: np.ndarray, limit: int) -> int:
        """Blocks the root path to ``node`` shares with ``slots[:limit]``.

        Walks up from ``node``: cheap when the request extends the node's path, as the next
        turn of a conversation does; ``depth(node)`` steps at worst.
        """
        parent = self._parent.data
        d = int(self._depth.data[node])
        while d > limit:
            node = int(parent[node])
            d -= 1
        while d > 0 and int(slots[d - 1]) != node:
            node = int(parent[node])
            d -= 1
        return d

    def insert(self, slots: np.ndarray, known: int | None = None) -> None:
        """Add a request's path. ``known``: its ``known_prefix``, if the caller has it."""
        n = len(slots)
        if not n:
            return
        if known is None:
            known = self.known_prefix(slots)
        parent = self._parent.data
        if known:
            # The known part must sit where it sat before (prefix hashes guarantee it).
            expect = np.empty(known, dtype=np.int64)
            expect[0] = -1
            expect[1:] = slots[: known - 1]
            self.inconsistent += int(np.count_nonzero(parent[slots[:known]] != expect))
        tail = slots[known:]
        if len(tail):
            if (parent[tail] != _UNSET).any():
                self._insert_mixed(slots)
            else:
                # The usual case: everything after the first new block is new.
                first_parent = int(slots[known - 1]) if known else -1
                parent[tail[0]] = first_parent
                parent[tail[1:]] = tail[:-1]
                self._depth.data[tail] = np.arange(known + 1, n + 1)
                children = self._children.data
                if first_parent >= 0:
                    children[first_parent] += 1
                else:
                    self.root_children += 1
                children[tail[:-1]] += 1
                self.distinct += len(tail)
        self._count.data[slots] += 1
        self._ends.data[slots[-1]] += 1

    def _insert_mixed(self, slots: np.ndarray) -> None:
        """New and known blocks interleaved after the first new one: hash ids that are not
        prefix hashes. Record the new ones; count the blocks met under another parent."""
        n = len(slots)
        parent = self._parent.data
        prev = np.empty(n, dtype=np.int64)
        prev[0] = -1
        prev[1:] = slots[:-1]
        prior = parent[slots]
        new = prior == _UNSET
        self.inconsistent += int(np.count_nonzero(~new & (prior != prev)))
        positions = np.flatnonzero(new)
        # a block that only appears twice in this request is new once
        new_slots, first = np.unique(slots[new], return_index=True)
        positions = positions[first]
        parent[new_slots] = prev[positions]
        self._depth.data[new_slots] = positions + 1
        new_parents = prev[positions]
        np.add.at(self._children.data, new_parents[new_parents >= 0], 1)
        self.root_children += int(np.count_nonzero(new_parents < 0))
        self.distinct += len(new_slots)

    def radix_nodes(self) -> tuple[np.ndarray, np.ndarray]:
        """(depth in blocks, requests through it) of every radix node."""
        size = self.index.size
        parent = self._parent.data[:size]
        used = parent != _UNSET
        children = self._children.data[:size]
        ends = self._ends.data[:size]
        node = used & ((ends > 0) | (children != 1))
        return self._depth.data[:size][node], self._count.data[:size][node]

    def repetition(
        self, block_tokens: int, min_tokens: Sequence[int], min_counts: Sequence[int]
    ) -> list[RepetitionRow]:
        """How many distinct prefixes of >= L tokens recur in >= N requests, for each (L, N)."""
        depth, count = self.radix_nodes()
        tokens = depth.astype(np.int64) * block_tokens
        rows = []
        for length in min_tokens:
            long_enough = count[tokens >= length]
            rows.append(
                RepetitionRow(
                    length, {c: int(np.count_nonzero(long_enough >= c)) for c in min_counts}
                )
            )
        return rows

    def top_prefixes(self, block_tokens: int, k: int, min_count: int = 2) -> list[tuple[int, int]]:
        """The ``k`` radix prefixes carrying the most reused tokens: (tokens, requests)."""
        depth, count = self.radix_nodes()
        keep = count >= min_count
        depth, count = depth[keep].astype(np.int64), count[keep]
        weight = depth * (count - 1)  # tokens a cache saves on this prefix
        order = np.argsort(-weight, kind="stable")[:k]
        return [(int(depth[i]) * block_tokens, int(count[i])) for i in order]
