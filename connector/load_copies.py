"""What a load hands the workers: per TP rank, the copies that fill the loaded blocks.

A lookup leased, per rank, one stored chunk per chunk of the run (``LookupOutcome.hits``);
vLLM allocated blocks for the tokens it will count as loaded. Each real block of those tokens
(``group_blocks.load_blocks``: all of them for full attention, the window's for a sliding
window) is filled from the chunk that holds it, and consecutive blocks of one chunk and KV
cache group travel as one copy. Pure functions: unit-tested without a store.
"""

from __future__ import annotations

import dataclasses

from kvtier.connector.group_blocks import GroupBlocks, UnfillableBlocks, load_blocks
from kvtier.connector.layout import MAMBA, KvGeometry
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.request_state import LookupOutcome


def load_copies(
    geometry: KvGeometry,
    outcome: LookupOutcome,
    block_ids: GroupBlocks,
    num_external_tokens: int,
    null_block: int,
) -> dict[int, list[ChunkCopy]]:
    """Per rank, the copies filling every real block of the ``num_external_tokens`` after
    the outcome's local hit. Raises ``UnfillableBlocks`` when a real block lies outside what
    the chunks keep (the load fails: vLLM recomputes, no block is left unfilled)."""
    first_block = outcome.computed // geometry.block_size
    n_blocks = num_external_tokens // geometry.block_size
    targets = load_blocks(geometry, block_ids, first_block, n_blocks, null_block)
    out: dict[int, list[ChunkCopy]] = {}
    for rank, hits in outcome.hits.items():
        copies: list[ChunkCopy] = []
        for group, b, within, block_id in targets:
            loc = hits[b // geometry.blocks_per_chunk - outcome.first_chunk]
            if geometry.groups[group].kind == MAMBA and loc.size < geometry.chunk_bytes:
                # vLLM wants a state the chunk was stored without (lookups end hits on whole
                # chunks, so vLLM asked for one they did not promise): fail, never guess
                raise UnfillableBlocks(f"block {b} needs a state its chunk was stored without")
            last = copies[-1] if copies else None
            if (
                last is not None
                and last.extents == loc.extents
                and last.group == group
                and last.first_block + len(last.block_ids) == within
            ):
                copies[-1] = dataclasses.replace(last, block_ids=(*last.block_ids, block_id))
            else:
                copies.append(
                    ChunkCopy(loc.extents, loc.checksum, within, (block_id,), loc.key, group)
                )
        out[rank] = copies
    return out


def tokens_by_tier(sources: dict[str, int], tokens: int) -> dict[str, int]:
    """The first ``tokens`` of a lookup's run, by the tier they came from (in order): what a
    load of ``tokens`` counts as hits of each tier."""
    out: dict[str, int] = {}
    for tier, n in sources.items():
        take = min(n, tokens - sum(out.values()))
        if take > 0:
            out[tier] = take
    return out
