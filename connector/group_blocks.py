"""Which of a request's KV blocks, group by group, a chunk's copies move.

vLLM keeps one block table per KV cache group (``KVCacheManager.get_block_ids()``: a tuple of
lists, indexed by ``GroupGeometry.source``). A full-attention group holds a real block at
every position; a sliding-window group holds vLLM's null block wherever the window has
passed, and real blocks only for the last window of computed tokens (and for what a step is
computing). A chunk keeps each group's trailing ``kept_blocks`` (``layout.py``), so:

- a **save** of chunk ``c`` copies, per group, the kept blocks of that chunk; when any of
  them is no longer the request's (a null block: the window passed them before the copy, as
  for a save deferred while pool space was late) the chunk is not saved at all, except that
  a chunk vLLM wrote no Mamba state for is saved without it (``save_blocks``: its attention
  alone, which a hit may pass through but not end on);
- a **load** ending at a chunk boundary fills, per group, the real blocks vLLM allocated
  for the loaded tokens: all of them for full attention, the window's for a sliding window,
  which lie inside the kept blocks of their chunks. A real block outside them cannot be
  filled and fails the load (vLLM recomputes), never left unloaded.

Pure functions over plain lists: unit-tested without vLLM (tests/unit/connector).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.connector.layout import MAMBA, KvGeometry

GroupBlocks = Sequence[Sequence[int]]  # per vLLM KV cache group: the request's block ids


class UnfillableBlocks(ValueError):
    """vLLM expects KV in a block no stored chunk holds."""


def chunk_save_blocks(
    geometry: KvGeometry, blocks: GroupBlocks, chunk: int, null_block: int
) -> list[tuple[int, tuple[int, ...]]] | None:
    """(group, block ids) of chunk ``chunk``'s kept blocks, or None when a kept block is
    not the request's any more (or not allocated): the chunk cannot be saved whole."""
    out = []
    for index, group in enumerate(geometry.groups):
        ids = _kept_ids(geometry, blocks, chunk, index)
        if len(ids) != group.kept_blocks or null_block in ids:
            return None
        out.append((index, ids))
    return out


def save_blocks(
    geometry: KvGeometry, blocks: GroupBlocks, chunk: int, null_block: int
) -> tuple[list[tuple[int, tuple[int, ...]]], bool] | None:
    """What a save of chunk ``chunk`` copies and whether that is its attention alone: the
    whole chunk (``chunk_save_blocks``), else for a model with state whose only lack is the
    state (a prefill step ran past the boundary) every other group's blocks; None when it
    cannot be saved."""
    whole = chunk_save_blocks(geometry, blocks, chunk, null_block)
    if whole is not None:
        return whole, False
    if not lacks_state_only(geometry, blocks, chunk, null_block):
        return None
    return [
        (index, _kept_ids(geometry, blocks, chunk, index))
        for index, group in enumerate(geometry.groups)
        if group.kind != MAMBA
    ], True


def _kept_ids(geometry: KvGeometry, blocks: GroupBlocks, chunk: int, group: int) -> tuple[int, ...]:
    """The block ids of chunk ``chunk`` that group ``group`` keeps (fewer: not allocated)."""
    bpc = geometry.blocks_per_chunk
    table = blocks[geometry.groups[group].source]
    return tuple(table[chunk * bpc + geometry.kept_from(group) : (chunk + 1) * bpc])


def lacks_state_only(
    geometry: KvGeometry, blocks: GroupBlocks, chunk: int, null_block: int
) -> bool:
    """Chunk ``chunk`` cannot be saved only because vLLM wrote no Mamba state at its end (a
    step ran past the boundary), not because a block was freed or is missing."""
    lacking = False
    for index, group in enumerate(geometry.groups):
        ids = _kept_ids(geometry, blocks, chunk, index)
        if len(ids) != group.kept_blocks:
            return False
        if null_block in ids:
            if group.kind != MAMBA:
                return False
            lacking = True
    return lacking


def load_blocks(
    geometry: KvGeometry, blocks: GroupBlocks, first_block: int, n_blocks: int, null_block: int
) -> list[tuple[int, int, int, int]]:
    """(group, block position in the request, position among its chunk's kept blocks,
    block id) for every real block of ``[first_block, first_block + n_blocks)`` a load
    must fill. Raises UnfillableBlocks for one outside its chunk's kept blocks."""
    bpc = geometry.blocks_per_chunk
    out = []
    for index, group in enumerate(geometry.groups):
        table = blocks[group.source]
        kept_from = geometry.kept_from(index)
        for b in range(first_block, first_block + n_blocks):
            block_id = table[b]
            if block_id == null_block:
                continue
            within = b % bpc - kept_from
            if within < 0:
                raise UnfillableBlocks(
                    f"block {b} of group {index} ({group.label()}) lies outside what a chunk keeps"
                )
            out.append((index, b, within, block_id))
    return out


def real_blocks(
    geometry: KvGeometry, blocks: GroupBlocks, first_block: int, n_blocks: int, null_block: int
) -> list[int]:
    """Every real block id of ``[first_block, first_block + n_blocks)``, group after group."""
    return [
        block_id
        for group in geometry.groups
        for block_id in blocks[group.source][first_block : first_block + n_blocks]
        if block_id != null_block
    ]
