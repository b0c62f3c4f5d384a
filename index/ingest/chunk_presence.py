"""Which chunks a vLLM instance holds in each medium, counted, and the chunk ops that changes
in it produce: the bookkeeping half of ``vllm_blocks.BlockMapper``.

A chunk is held in a medium when every block of its span is (each block counts its copies
per medium, packed in its record's REFS, see ``block_records``); a block appearing in a medium
may complete chunks through it, one leaving it breaks them. Chunks are counted too, since a
chunk inside blocks larger than it can be held by several blocks. A change in a chunk's
presence becomes a pending op, batched per kind and tier, until ``take_ops``; ``holdings`` is
the whole state, for a resync.

This is a mixin rather than a component the mapper holds because its methods run on the
mapper's per-block path (a duplicate block's ``_add_ref``, a new chunk's ``_emit``): as
methods of the mapper they cost one call, as a component's they would cost an attribute
lookup more. It owns ``_chunks_held`` and ``_pending`` and reads the mapper's blocks, windows
and namespace sets (declared below).

Threading: not thread-safe; part of the mapper, owned by its follower thread.
"""

from __future__ import annotations

from typing import Any

from kvtier.core.chunks import Tier
from kvtier.index.api import ChunkOp
from kvtier.index.ingest.block_records import (
    COUNT,
    DONE,
    END,
    MEDIUM_TIERS,
    ONE,
    PARENT,
    REFS,
    SHIFT,
    START,
    WIN,
    Block,
    Keys,
    Window,
)
from kvtier.index.ingest.vllm_wire import BlockHash
from kvtier.store.api.events import EventKind


class ChunkPresence:
    """Presence of chunks per medium and the ops it emits, for ``BlockMapper``."""

    # the mapper's state this reads (set by BlockMapper.__init__)
    chunk_tokens: int
    _blocks: dict[BlockHash, Block]
    _windows: dict[BlockHash, Window]
    _nsets: list[tuple[bytes, ...]]  # namespace ids per namespace set (Window.nsx)
    # the state this owns (also set, and reset, by the mapper)
    _pending: list[list[Any]]  # [kind, tier, {ns: [keys]}] in order
    # chunks held per medium, counted: a chunk inside blocks larger than it can be held by
    # several blocks (same first tokens, different rest)
    _chunks_held: list[dict[tuple[int, Keys], int]]

    def take_ops(self) -> list[ChunkOp]:
        """The chunk ops produced since the last call, in order."""
        ops = [
            ChunkOp(kind, tier, ns, tuple(keys))
            for kind, tier, by_ns in self._pending
            for ns, keys in (by_ns.items() if by_ns else [(b"", [])])
        ]
        self._pending = []
        return ops

    def holdings(self) -> dict[Tier, dict[bytes, list[bytes]]]:
        """Every chunk held, per tier and namespace: the whole state, for a resync."""
        out: dict[Tier, dict[bytes, list[bytes]]] = {}
        for m, held in enumerate(self._chunks_held):
            if held:
                by_ns = out.setdefault(MEDIUM_TIERS[m], {})
                for nsx, keys in held:
                    for ns, key in zip(self._nsets[nsx], keys, strict=True):
                        by_ns.setdefault(ns, []).append(key)
        return out

    # -- internals, for the mapper ----------------------------------------------------------

    def _held(self, h: BlockHash, blk: Block, m: int) -> bool:
        """Is the chunk ending in ``blk`` held in medium ``m`` (every block of it present)?"""
        shift = SHIFT * m
        if blk[END] - blk[START] > self.chunk_tokens:  # whole windows in one block
            return bool((blk[REFS] >> shift) & COUNT)
        win = blk[WIN]
        cur: Block | None = blk
        while True:
            if cur is None or cur[WIN] is not win or not (cur[REFS] >> shift) & COUNT:
                return False
            if cur[START] <= win.start:
                return True
            cur = self._blocks.get(cur[PARENT])

    def _recheck(self, h: BlockHash, blk: Block, m: int, kind: EventKind) -> None:
        """``blk`` just appeared in medium ``m`` / is about to leave it: emit every chunk
        through it that this completes / breaks."""
        win = blk[WIN]
        if win is None:
            return
        if blk[END] - blk[START] > self.chunk_tokens:
            if (blk[REFS] >> (SHIFT * m)) & COUNT:
                for keys in blk[DONE]:
                    self._emit(kind, m, win, keys)
            return
        for keys, end_hash in win.chunks_through(h):
            last = self._blocks.get(end_hash)
            if last is not None and last[WIN] is win and self._held(end_hash, last, m):
                self._emit(kind, m, win, keys)

    def _add_ref(self, h: BlockHash, blk: Block, m: int) -> None:
        first = not (blk[REFS] >> (SHIFT * m)) & COUNT
        blk[REFS] += ONE[m]
        if first:
            self._recheck(h, blk, m, EventKind.STORED)

    def _emit(self, kind: EventKind, m: int, win: Window, keys: Keys) -> None:
        held = self._chunks_held[m]
        name = (win.nsx, keys)
        count = held.get(name, 0)
        if kind is EventKind.STORED:
            held[name] = count + 1
            if count:
                return
        elif count > 1:
            held[name] = count - 1
            return
        elif count == 1:
            del held[name]
        else:  # pragma: no cover - every removal follows its store
            return
        tier = MEDIUM_TIERS[m]
        pending = self._pending
        if pending and pending[-1][0] is kind and pending[-1][1] is tier:
            by_ns = pending[-1][2]
        else:
            by_ns = {}
            pending.append([kind, tier, by_ns])
        for ns, key in zip(self._nsets[win.nsx], keys, strict=True):
            got = by_ns.get(ns)
            if got is None:
                by_ns[ns] = [key]
            else:
                got.append(key)

    def _release(self, blk: Block) -> None:
        """``blk`` leaves its window; the window goes with its last block."""
        win: Window | None = blk[WIN]
        blk[WIN] = None
        if win is not None:
            win.live -= 1
            first = win.first
            if not win.live and self._windows.get(first) is win:
                del self._windows[first]

    def _forget(self, h: BlockHash, blk: Block) -> None:
        """``blk`` is in no medium any more: drop its record."""
        del self._blocks[h]
        self._release(blk)
