"""Per-block bookkeeping without a Python object per block.

Trace hash ids are usually small dense integers (Mooncake remaps its hashes), so a block's
attributes live in numpy arrays indexed by the id itself. Traces whose ids are large (raw 64-bit
hashes) switch, at the first such id, to a dict that hands out dense slots; ids seen before the
switch keep their slot. One dict entry per block is the only per-block Python object then.

Threading: none of this is thread-safe; one analysis owns its index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DIRECT_LIMIT = 1 << 26  # ids below this index arrays directly (64 M slots at most)


class GrowArray:
    """A numpy array that grows (doubling) to cover any index it is asked about."""

    def __init__(self, dtype: type | np.dtype, fill: int | float = 0, size: int = 1024) -> None:
        self.fill = fill
        self.data = np.full(size, fill, dtype=dtype)

    def ensure(self, n: int) -> np.ndarray:
        """Make slots [0, n) valid; returns the (possibly new) backing array."""
        if n > len(self.data):
            size = max(n, 2 * len(self.data))
            grown = np.full(size, self.fill, dtype=self.data.dtype)
            grown[: len(self.data)] = self.data
            self.data = grown
        return self.data


class BlockIndex:
    """Maps hash ids to dense slots (see the module docstring). ``size`` bounds every slot.

    Per-block arrays made with ``array`` always cover every slot handed out, so hot loops
    index ``.data`` without checking.
    """

    def __init__(self) -> None:
        self.size = 0  # 1 + the largest slot handed out
        self._remap: dict[int, int] | None = None
        self._known = GrowArray(np.bool_, False)  # direct mode: which ids were seen
        self._arrays: list[GrowArray] = []

    def array(self, dtype: type | np.dtype, fill: int | float = 0) -> GrowArray:
        arr = GrowArray(dtype, fill)
        arr.ensure(self.size)
        self._arrays.append(arr)
        return arr

    def _grew(self) -> None:
        for arr in self._arrays:
            if len(arr.data) < self.size:
                arr.ensure(self.size)

    def slots(self, hash_ids: Sequence[int]) -> np.ndarray:
        if not hash_ids:
            return np.empty(0, dtype=np.int64)
        if self._remap is None:
            ids = np.asarray(hash_ids, dtype=object if _huge(hash_ids) else np.int64)
            if ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < DIRECT_LIMIT:
                top = int(ids.max()) + 1
                if top > self.size:
                    self.size = top
                    self._grew()
                self._known.ensure(self.size)[ids] = True
                return ids
            self._switch_to_dict()
        remap = self._remap
        assert remap is not None
        out = np.empty(len(hash_ids), dtype=np.int64)
        for i, h in enumerate(hash_ids):
            slot = remap.get(h)
            if slot is None:
                slot = remap[h] = self.size
                self.size += 1
            out[i] = slot
        self._grew()
        return out

    def _switch_to_dict(self) -> None:
        known = np.flatnonzero(self._known.data[: self.size])
        self._remap = {int(h): int(h) for h in known}
        self._known = GrowArray(np.bool_, False, 1)


def _huge(hash_ids: Sequence[int]) -> bool:
    # Python ints beyond int64 would overflow np.asarray; cheap bound check on the extremes.
    return max(hash_ids) >= 1 << 63 or min(hash_ids) < -(1 << 63)
