"""Page allocator for the DRAM pool: chunks of any size share one pool without fragmenting it.

The pool is cut into fixed pages. A chunk takes ceil(size / page) pages as one or more runs of
contiguous pages (extents). A request is served from the smallest free run that fits (best fit,
so large runs stay whole); when no single run fits it is stitched together from the largest
runs. Because a chunk never *needs* contiguity, an allocation succeeds whenever enough pages are
free in total: external fragmentation cannot make a put fail, and the store's eviction only has
to free a number of pages, not a particular hole. Internal waste is under one page per chunk.

Not thread-safe: the store serialises calls under its lock.
"""

from __future__ import annotations

from sortedcontainers import SortedList

# (first page, number of pages)
PageRun = tuple[int, int]


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("a pool needs at least one page")
        self.num_pages = num_pages
        self.free_pages = num_pages
        # Free runs, indexed three ways: by start (coalescing with the right neighbour),
        # by end (the left neighbour) and by (length, start) (best fit).
        self._by_start: dict[int, int] = {0: num_pages}
        self._by_end: dict[int, int] = {num_pages: 0}
        self._by_size: SortedList = SortedList([(num_pages, 0)])

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def allocate(self, pages: int) -> list[PageRun] | None:
        """Pages as runs (fewest runs the free space allows), or None if not enough are free."""
        if pages <= 0:
            raise ValueError("allocate at least one page")
        if pages > self.free_pages:
            return None
        idx = self._by_size.bisect_left((pages, -1))
        if idx < len(self._by_size):
            length, start = self._by_size[idx]
            self._take(start, length, pages)
            return [(start, pages)]
        runs: list[PageRun] = []
        need = pages
        while need:
            length, start = self._by_size[-1]
            take = min(length, need)
            self._take(start, length, take)
            runs.append((start, take))
            need -= take
        return runs

    def free(self, runs: list[PageRun]) -> None:
        for start, length in runs:
            self._release(start, length)

    def free_runs(self) -> list[PageRun]:
        return sorted(self._by_start.items())

    def largest_free_run(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    # -- internals -------------------------------------------------------------------------

    def _take(self, start: int, length: int, take: int) -> None:
        self._remove_run(start, length)
        if take < length:
            self._add_run(start + take, length - take)
        self.free_pages -= take

    def _release(self, start: int, length: int) -> None:
        if length <= 0 or start < 0 or start + length > self.num_pages:
            raise ValueError(f"run ({start}, {length}) outside the pool")
        end = start + length
        left = self._by_end.get(start)
        if left is not None:  # a free run ends exactly where this one starts
            self._remove_run(left, start - left)
            start = left
        right_len = self._by_start.get(end)
        if right_len is not None:
            self._remove_run(end, right_len)
            end += right_len
        self._add_run(start, end - start)
        self.free_pages += length

    def _add_run(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))

    def _remove_run(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        self._by_size.remove((length, start))
