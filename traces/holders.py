"""Which caches hold each block, as one int bitmap per block: leading runs for a whole fleet in
one walk over a prompt's blocks.

The simulator needs, per request, every instance's leading GPU run and every node's pool runs.
Asking each cache (``BlockCache.match``) costs O(caches x blocks) per request; at 1,000
instances that is most of the time. ``Holders`` keeps, per block, the set of caches holding it
as the bits of a Python int (bit m = cache m), maintained from what ``BlockCache.store`` reports
(inserted, evicted), so a prompt's runs for all caches come from ANDing its blocks' bitmaps
(the idea of ``leading_runs`` in index/backends/memory.py, over caches instead of slots). A
cache that holds nothing of the prompt costs nothing beyond its zero in the output array.

Threading: not thread-safe. Memory: one dict entry per block some cache holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

Key = Hashable


class Holders:
    def __init__(self, members: int) -> None:
        self.members = members
        self._bytes = (members + 7) // 8
        self._bits: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._bits)

    def get(self, key: Key) -> int:
        """The bitmap of the members holding ``key`` (0: none)."""
        return self._bits.get(key, 0)

    def update(self, member: int, inserted: Iterable[Key], evicted: Iterable[Key]) -> None:
        """``member``'s cache evicted ``evicted`` and then inserted ``inserted`` (one store).

        Evictions first: one store can evict a key and insert it again later in its batch
        (``BlockCache.store``), and the key is held afterwards."""
        bits = self._bits
        bit = 1 << member
        for key in evicted:
            left = bits[key] ^ bit
            if left:
                bits[key] = left
            else:
                del bits[key]
        for key in inserted:
            bits[key] = bits.get(key, 0) | bit

    def bitmaps(self, keys: Sequence[Key]) -> list[int]:
        """Per key, the bitmap of the members holding it."""
        get = self._bits.get
        return [get(key, 0) for key in keys]

    def matrix(self, keys: Sequence[Key]) -> np.ndarray:
        """(len(keys), members) bool: member m holds keys[j]."""
        return self.unpack(self.bitmaps(keys))

    def leading_runs(self, keys: Sequence[Key]) -> tuple[np.ndarray, int]:
        """Per member (int64): how many leading keys it holds, i.e. ``BlockCache.match``;
        and the longest of those runs."""
        get = self._bits.get
        rows = []  # rows[j]: the members holding keys[0..j]; each row a subset of the last
        alive = -1  # every member (an int with all bits set)
        for key in keys:
            alive &= get(key, 0)
            if not alive:
                break
            rows.append(alive)
        if not rows:
            return np.zeros(self.members, dtype=np.int64), 0
        return self.unpack(rows).sum(axis=0, dtype=np.int64), len(rows)

    def unpack(self, rows: list[int]) -> np.ndarray:
        """Bitmaps as a (len(rows), members) bool matrix."""
        nbytes = self._bytes
        raw = b"".join(x.to_bytes(nbytes, "little") for x in rows)
        packed = np.frombuffer(raw, dtype=np.uint8).reshape(len(rows), nbytes)
        bits = np.unpackbits(packed, axis=1, count=self.members, bitorder="little")
        return bits.view(np.bool_)


def next_false(held: np.ndarray) -> np.ndarray:
    """For a (n, m) bool matrix: out[s, k] = the first row t >= s with ``held[t, k]`` False, or n;
    shape (n + 1, m), row n all n. So the run of True from row s in column k is out[s, k] - s."""
    n, m = held.shape
    out = np.empty((n + 1, m), dtype=np.int64)
    out[n] = n
    if n:
        first = np.where(held, n, np.arange(n, dtype=np.int64)[:, None])
        out[:n] = np.minimum.accumulate(first[::-1], axis=0)[::-1]
    return out
