"""How ``BlockMapper`` records vLLM blocks and the chunk windows they fall in, and how it
holds and keys their tokens.

The mapper holds one record per cached block (a vLLM instance caches millions), so records
are plain lists indexed by the constants below (creating one costs half a ``__slots__``
object), and a block's presence in the three media is one packed int. Tokens are kept as
u32le bytes (``BlockStored.tokens_u32le``), the form chunk keys hash (``chunk_keys_after``). See
``vllm_blocks`` for what the records mean to the mapping, ``chunk_presence`` for the counts.

Threading: owned by one mapper, which is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.chunks import Tier
from kvtier.core.keys import key_digest
from kvtier.index.ingest.vllm_wire import BlockHash

MEDIA: dict[str | None, int] = {"GPU": 0, "CPU": 1, "STORAGE": 2, None: 0}
MEDIUM_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
SHIFT = 20  # bits per medium in a block's packed presence counts
ONE = tuple(1 << (SHIFT * m) for m in range(3))
COUNT = (1 << SHIFT) - 1
Keys = tuple[bytes, ...]  # one chunk's keys, one per namespace of the instance
ChunkRef = tuple[Keys, BlockHash]  # a chunk and the block it ends in


class Window:
    """One chunk's span of tokens along one prefix: shared by the blocks inside it (and by
    the branches that fork inside it). Lives as long as a block refers to it."""

    __slots__ = ("chain", "first", "live", "nsx", "spans", "start")

    def __init__(self, chain: Keys, start: int, nsx: int, first: BlockHash) -> None:
        self.chain = chain  # keys of the chunk before the window (the roots at offset 0)
        self.start = start
        self.nsx = nsx  # which derived namespace set
        self.first = first  # hash of its first block (its name in BlockMapper._windows)
        self.live = 0  # blocks referring to it
        # The chunks completed in it, and the blocks each runs through. Almost every window
        # completes one chunk, so that is kept as (its ref, its blocks) and the map from
        # block to chunks is built only when a second chunk completes (branches inside it):
        # building that map for every chunk cost a fifth of ingest. None = none completed.
        self.spans: Spans = None

    def chunks_through(self, h: BlockHash) -> tuple[ChunkRef, ...]:
        spans = self.spans
        if spans is None:
            return ()
        if isinstance(spans, tuple):
            refs, path = spans
            return refs if h in path else ()
        return spans.get(h, ())

    def add_chunk(self, ref: ChunkRef, path: Sequence[BlockHash]) -> None:
        """The chunk ``ref`` completed along ``path`` (the window's blocks, in any order)."""
        spans = self.spans
        one = (ref,)
        if spans is None:
            self.spans = (one, path)
            return
        if isinstance(spans, tuple):
            refs, old = spans
            spans = self.spans = dict.fromkeys(old, refs)
        for bh in path:
            got = spans.get(bh)
            if got is None:
                spans[bh] = one
            elif ref not in got:
                spans[bh] = got + one


Spans = (
    dict[BlockHash, tuple[ChunkRef, ...]] | tuple[tuple[ChunkRef, ...], Sequence[BlockHash]] | None
)


# A block's record is a list (creating one costs half a __slots__ object, and the hot path
# creates one per block). Field indices:
PARENT = 0  # engine hash of the block before it (None for a prompt's first block)
START = 1  # token offset of its first token
END = 2  # token offset after its last token
WIN = 3  # its Window; None = opaque
TAIL = 4  # its own tokens (u32le), or its whole chunk's when stored with it (see tail_of);
# None for a block that ends a chunk (nothing later in its window needs its tokens) or is opaque
REFS = 5  # presence count per medium, packed (SHIFT bits each)
DONE = 6  # keys of the chunks that end in it: tuple[Keys, ...]
Block = list  # [parent, start, end, win, tail, refs, done]


def tail_of(blk: Block, win: Window) -> bytes:
    """The tokens of ``blk`` (u32le), whose TAIL is its own or its whole chunk's."""
    tail: bytes = blk[TAIL]
    start, end = blk[START], blk[END]
    if len(tail) == 4 * (end - start):
        return tail
    return tail[4 * (start - win.start) : 4 * (end - win.start)]


def chunk_keys_after(chain: Keys, body: bytes) -> Keys:
    """The keys of the chunk of tokens ``body`` (u32le) after the chunk keyed ``chain``, one
    per namespace (nearly always one: no tuple built from a generator then)."""
    if len(chain) == 1:
        return (key_digest(chain[0] + body),)
    return tuple(key_digest(k + body) for k in chain)
