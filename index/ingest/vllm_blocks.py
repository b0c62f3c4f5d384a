"""vLLM blocks -> kvtier chunks, for one engine instance.

vLLM names a cached block by an engine hash chained over its prefix; kvtier names a chunk of
``chunk_tokens`` tokens by a canonical key chained the same way (docs/keys/spec.md). A
``BlockStored`` event carries the token ids of its blocks and the hash of the block before
them, which is enough to compute canonical keys without reproducing vLLM's hash (so neither
its algorithm nor ``PYTHONHASHSEED`` matters). This module keeps, per engine hash, what the
next block needs to continue the chain, and turns stored/removed/cleared blocks into
stored/removed/cleared chunk entries. Its block records are laid out in ``block_records``;
which chunks each medium holds, and the ops that changes in it produce, is ``chunk_presence``.

Geometry. With token offsets ``[start, end)`` per block (a block starts where its parent
ends), a *window* is one chunk's span ``[w, w + C)``:

- a block inside one window (block size divides C, the usual case) keeps its own tokens
  (``tail``) until the window is complete; the block that ends the window gathers the tails
  of its ancestors in that window and computes the chunk key;
- a block covering whole windows (C divides the block size) computes its keys at once;
- a block that straddles a window boundary partly (sizes that do not divide one another)
  cannot be mapped and is *opaque*, as are blocks whose extra hash keys make their KV differ
  from plain tokens (multimodal inputs, prompt embeddings) and blocks whose parent is unknown
  (an event lost before the index started). Children of opaque blocks are opaque.

A chunk is held in a medium when every block of its span is; a block removed from a medium
removes every chunk whose span includes it. vLLM may cache the same hash in two physical
blocks (two requests computing the same prefix at once) and then stores and removes it twice,
so presence is a count per medium. Cache salts select a derived namespace (``cache_salt=`` the
salt's digest) so their keys match a router that keys the same request; blocks of LoRA
requests are opaque (their namespace names the adapter's weights, which events do not carry).

Threading: not thread-safe; one mapper per instance, owned by its follower thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, salt_digest
from kvtier.core.keys import key_digest as _digest
from kvtier.index.ingest.block_records import (
    COUNT,
    DONE,
    END,
    MEDIA,
    ONE,
    PARENT,
    REFS,
    SHIFT,
    START,
    TAIL,
    WIN,
    Block,
    Keys,
    Window,
    chunk_keys_after,
    tail_of,
)
from kvtier.index.ingest.chunk_presence import ChunkPresence
from kvtier.index.ingest.native import new_records
from kvtier.index.ingest.vllm_wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvEvent,
)
from kvtier.store.api.events import EventKind


class BlockMapper(ChunkPresence):
    """Maps one instance's KV events to chunk ops. See the module docstring; the presence
    counts and the ops they emit are ``ChunkPresence``'s."""

    def __init__(self, namespaces: Sequence[Namespace]) -> None:
        if not namespaces:
            raise ValueError("an instance serves at least one namespace")
        sizes = {ns.chunk_tokens for ns in namespaces}
        if len(sizes) != 1:
            raise ValueError(f"an instance's namespaces share one chunk_tokens, got {sizes}")
        self.chunk_tokens = sizes.pop()
        self._base = tuple(namespaces)
        self._nsets: list[tuple[bytes, ...]] = [tuple(ns.root_key() for ns in namespaces)]
        self._nsx: dict[tuple[str, str], int] = {("", ""): 0}
        self.new_namespaces: list[Namespace] = []  # derived ones not yet reported
        self._blocks: dict[BlockHash, Block] = {}
        self._windows: dict[BlockHash, Window] = {}
        self._group: int | None = None  # the full-attention KV cache group we follow
        self._pending = []  # these two: see ChunkPresence
        self._chunks_held = [{}, {}, {}]
        self.counts: Counter[str] = Counter()

    # -- public -----------------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def namespace_ids(self) -> list[bytes]:
        return [ns for nset in self._nsets for ns in nset]

    def feed(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                self.stored(event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self.removed(event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self.cleared()

    def reset(self) -> None:
        """Forget everything (the engine restarted)."""
        self._blocks.clear()
        self._windows.clear()
        self._group = None
        self._pending = []
        self._chunks_held = [{}, {}, {}]

    # -- events -----------------------------------------------------------------------------

    def _follows(self, group: int | None, kind: str | None) -> bool:
        if kind not in (None, "full_attention"):
            return False
        group = group or 0
        if self._group is None:
            self._group = group
        return group == self._group

    def stored(self, ev: BlockStored) -> None:
        if not self._follows(ev.group_idx, ev.kv_cache_spec_kind):
            self.counts["other_group"] += len(ev.block_hashes)
            return
        m = MEDIA.get(ev.medium, -1)
        if m < 0:
            self.counts["unknown_medium"] += 1
            return
        bs = ev.block_size
        hashes = ev.block_hashes
        blocks = self._blocks
        if bs <= 0 or not ev.num_tokens:  # token-less (an offloading tier): known hashes only
            for h in hashes:
                blk = blocks.get(h)
                if blk is None:
                    self.counts["unknown_hash"] += 1
                else:
                    self._add_ref(h, blk, m)
            return
        if ev.num_tokens != bs * len(hashes):
            self.counts["malformed"] += 1
            return
        try:
            data = ev.tokens_u32le()  # as the C decoder read them, or packed here
        except (OverflowError, TypeError):
            self.counts["malformed"] += 1
            return
        parent_hash = ev.parent_block_hash
        parent = None if parent_hash is None else blocks.get(parent_hash)
        if parent_hash is not None and parent is None:
            self.counts["unknown_parent"] += 1
        extra = ev.extra_keys
        plain = extra is None and ev.lora_name is None
        self.counts["blocks"] += len(hashes)
        start = first = 0 if parent is None else parent[END]
        C, n = self.chunk_tokens, len(hashes)
        if not (plain and C % bs == 0 and n * bs >= C and blocks.keys().isdisjoint(hashes)):
            self._stored_blocks(ev, data, 0, n, parent_hash, parent, first, m)
            return
        # Every block is new and plain (a prefill step's blocks): the chunks they complete
        # whole are made at once, the blocks around them one by one.
        per = C // bs
        i = 0
        while i < n:
            j = min(n, i + (C - start % C) // bs)  # up to the next chunk boundary
            if j - i == per:
                chain = self._chain_after(parent_hash, parent)
                if chain is not None and hashes[i] not in self._windows:
                    parent = self._new_chunk(hashes, i, data, (start - first) * 4, parent_hash,
                                             chain, start, bs, m)  # fmt: skip
                    parent_hash, start, i = hashes[j - 1], start + C, j
                    continue
            parent_hash, parent, start = self._stored_blocks(
                ev, data, i, j, parent_hash, parent, first, m
            )
            i = j

    def _stored_blocks(
        self,
        ev: BlockStored,
        data: bytes,
        lo: int,
        hi: int,
        parent_hash: BlockHash | None,
        parent: Block | None,
        first: int,
        m: int,
    ) -> tuple[BlockHash | None, Block | None, int]:
        """``stored`` for blocks ``lo:hi`` of ``ev`` one by one (``data`` holds the tokens of
        all its blocks, the first at offset ``first``); returns the last block and its end."""
        hashes, bs, extra, blocks = ev.block_hashes, ev.block_size, ev.extra_keys, self._blocks
        plain = extra is None and ev.lora_name is None
        width = 4 * bs
        start = 0 if parent is None else parent[END]
        fresh = first  # blocks from offset `fresh` on are new in this event
        one = ONE[m]
        C = self.chunk_tokens
        get = blocks.get
        for i in range(lo, hi):
            h = hashes[i]
            blk = get(h)
            if blk is not None:  # already cached (a duplicate block): one more copy
                self._add_ref(h, blk, m)
                parent_hash, parent, start = h, blk, blk[END]
                fresh = start  # blocks from here on are new in this event
                continue
            end = start + bs
            if parent is not None:
                win = parent[WIN]
                if win is not None and (plain or _plain_extra(ev, extra[i] if extra else None)):
                    offset = start % C
                    if offset and offset + bs < C and not win.spans:
                        # the hot path: a block in the middle of a chunk nobody completed yet
                        pos = i * width
                        blocks[h] = blk = [parent_hash, start, end, win, data[pos : pos + width],
                                           one, ()]  # fmt: skip
                        win.live += 1
                        parent_hash, parent, start = h, blk, end
                        continue
                    blocks[h] = blk = [parent_hash, start, end, None, None, one, ()]
                    if offset and offset + bs == C and end - C >= fresh:
                        # it completes a chunk whose blocks all arrived new in this event:
                        # their tokens are in `data` and they are all present in medium m
                        self._complete(h, blk, win, data, (end - C - first) * 4, hashes, i, m)
                        parent_hash, parent, start = h, blk, end
                        continue
                    tokens = data[i * width : (i + 1) * width]
                    self._place(h, blk, parent, tokens, win.nsx, m)
                else:
                    blocks[h] = blk = [parent_hash, start, end, None, None, one, ()]
            elif parent_hash is None:  # a prompt's first block
                blocks[h] = blk = [parent_hash, start, end, None, None, one, ()]
                nsx = 0 if plain else self._namespace_set(ev, extra[i] if extra else None)
                if nsx >= 0:
                    self._place(h, blk, None, data[i * width : (i + 1) * width], nsx, m)
            else:  # its parent is unknown (stored before we listened)
                blocks[h] = blk = [parent_hash, start, end, None, None, one, ()]
            win = blk[WIN]
            if win is None:  # its parent is unknown (stored before we listened) or opaque
                self.counts["opaque"] += 1
            elif blk[TAIL] is not None and win.chunks_through(h):
                # re-stored in the middle of chunks whose other blocks are still cached
                self._recheck(h, blk, m, EventKind.STORED)
            parent_hash, parent, start = h, blk, end
        return parent_hash, parent, start

    def _chain_after(
        self, parent_hash: BlockHash | None, parent: Block | None
    ) -> tuple[Keys, int] | None:
        """Keys of the chunk ending at ``parent`` (a chunk boundary) and their namespace set,
        which a plain block starting the next window continues; None = it cannot be keyed."""
        if parent is None:
            return None if parent_hash is not None else (self._nsets[0], 0)
        win = parent[WIN]
        if win is None or not parent[DONE]:
            return None
        return parent[DONE][-1], win.nsx

    def _new_chunk(
        self,
        hashes: list[BlockHash],
        i: int,
        data: bytes,
        offset: int,
        parent_hash: BlockHash | None,
        chain_nsx: tuple[Keys, int],
        start: int,
        bs: int,
        m: int,
    ) -> Block:
        """``_place`` for the new blocks ``hashes[i : i + C // bs]``, which start a window and
        fill it (their tokens at ``data[offset:]``): one record each, no walk. Returns the
        last, which ends the chunk."""
        C = self.chunk_tokens
        per = C // bs
        chain, nsx = chain_nsx
        body = data[offset : offset + 4 * C]
        keys = chunk_keys_after(chain, body)
        path = hashes[i : i + per]
        win = self._windows[path[0]] = Window(chain, start, nsx, path[0])
        win.live = per
        parents = hashes[i - 1 : i + per - 1] if i else [parent_hash, *path[:-1]]
        one = ONE[m]
        # the blocks inside share the chunk's tokens as their tail
        if new_records is not None:  # the same records, built in C (native.py)
            last = new_records(self._blocks, path, parents, start, bs, win, body, one)
        else:
            records: list[Block] = [
                [ph, s, s + bs, win, body, one, ()]
                for ph, s in zip(parents, range(start, start + C, bs), strict=True)
            ]
            last = records[-1]
            self._blocks.update(zip(path, records, strict=True))
        last[TAIL], last[DONE] = None, (keys,)
        win.add_chunk((keys, path[-1]), path)
        self._emit(EventKind.STORED, m, win, keys)
        return last

    def removed(self, ev: BlockRemoved) -> None:
        if ev.group_idx is not None and self._group is not None and ev.group_idx != self._group:
            return
        m = MEDIA.get(ev.medium, -1)
        if m < 0:
            self.counts["unknown_medium"] += 1
            return
        shift = SHIFT * m
        for h in ev.block_hashes:
            blk = self._blocks.get(h)
            if blk is None or not (blk[REFS] >> shift) & COUNT:
                self.counts["unknown_hash"] += 1
                continue
            if (blk[REFS] >> shift) & COUNT == 1:
                self._recheck(h, blk, m, EventKind.REMOVED)  # while still counted as held
            blk[REFS] -= ONE[m]
            if not blk[REFS]:
                self._forget(h, blk)

    def cleared(self) -> None:
        """AllBlocksCleared: vLLM reset its (GPU) prefix cache."""
        self._pending.append([EventKind.CLEARED, Tier.GPU, {}])
        self._chunks_held[0] = {}
        for h, blk in list(self._blocks.items()):
            if blk[REFS] & COUNT:
                blk[REFS] &= ~COUNT
                if not blk[REFS]:
                    self._forget(h, blk)

    # -- internals --------------------------------------------------------------------------

    def _place(
        self, h: BlockHash, blk: Block, parent: Block | None, tokens: bytes, nsx: int, m: int
    ) -> None:
        """Give the new block ``blk`` (present in medium ``m``) its window; compute and emit
        the chunks it completes, or keep its tokens for the block that will."""
        C = self.chunk_tokens
        start, end = blk[START], blk[END]
        if start % C == 0:  # begins a window
            if parent is None:
                chain = self._nsets[nsx]
            elif parent[DONE]:
                chain = parent[DONE][-1]
            else:  # pragma: no cover - a parent ending on a boundary completed a chunk
                return
        if start // C == (end - 1) // C:  # inside one window
            if start % C == 0:
                win = self._windows.get(h)
                if win is None or win.chain != chain:
                    win = self._windows[h] = Window(chain, start, nsx, h)
            else:
                assert parent is not None
                win = parent[WIN]
                assert win is not None
            win.live += 1
            blk[WIN] = win
            if end % C:
                blk[TAIL] = tokens
                return
            shift = SHIFT * m
            held = True
            parts, path = [tokens], [h]
            cur: Block = blk
            get = self._blocks.get
            while cur[START] > win.start:  # gather the window's earlier blocks on this path
                ph = cur[PARENT]
                parent_blk = get(ph)
                if parent_blk is None or parent_blk[WIN] is not win or parent_blk[TAIL] is None:
                    self._release(blk)  # an ancestor in the window is gone: cannot key it
                    return
                cur = parent_blk
                parts.append(tail_of(cur, win))
                path.append(ph)
                if held and not (cur[REFS] >> shift) & COUNT:
                    held = False
            parts.reverse()
            body = b"".join(parts)
            keys = chunk_keys_after(win.chain, body)
            blk[DONE] = (keys,)
            win.add_chunk((keys, h), path)
            if held:
                self._emit(EventKind.STORED, m, win, keys)
        elif start % C == 0 and end % C == 0:  # whole windows in one block
            win = Window(chain, start, nsx, h)
            win.live = 1
            blk[WIN] = win
            done, step = [], 4 * C
            for off in range(0, len(tokens), step):
                chain = tuple(_digest(k + tokens[off : off + step]) for k in chain)
                done.append(chain)
                self._emit(EventKind.STORED, m, win, chain)
            blk[DONE] = tuple(done)
        else:
            self.counts["unaligned"] += 1

    def _complete(
        self,
        h: BlockHash,
        blk: Block,
        win: Window,
        data: bytes,
        offset: int,
        hashes: list[BlockHash],
        i: int,
        m: int,
    ) -> None:
        """``_place`` for a chunk that arrived whole in one event (no walk needed)."""
        body = data[offset : offset + 4 * self.chunk_tokens]
        chain = win.chain
        keys = chunk_keys_after(chain, body)
        win.live += 1
        blk[WIN] = win
        blk[DONE] = (keys,)
        blocks_in_chunk = (blk[END] - win.start) // (blk[END] - blk[START])
        win.add_chunk((keys, h), hashes[i + 1 - blocks_in_chunk : i + 1])
        self._emit(EventKind.STORED, m, win, keys)

    def _namespace_set(self, ev: BlockStored, extra: Any) -> int:
        """Derived namespace set of a prompt's first block (-1 = opaque)."""
        lora = ev.lora_name or ""
        if lora:
            # A LoRA namespace holds the adapter's weights fingerprint, which its name does
            # not give: such blocks stay unknown to the index (a miss for routers, never a
            # wrong hit).
            return -1
        items = list(extra) if extra else []
        salt = ""
        for item in items:
            if not isinstance(item, str) or salt:
                return -1  # multimodal (mm_hash, offset) pairs, prompt-embedding digests
            salt = item  # cache_salt
        key = (lora, salt)
        nsx = self._nsx.get(key)
        if nsx is None:
            digest = salt_digest(salt)
            derived = [
                ns.model_copy(update={"cache_salt": digest or ns.cache_salt}) for ns in self._base
            ]
            nsx = len(self._nsets)
            self._nsets.append(tuple(ns.root_key() for ns in derived))
            self._nsx[key] = nsx
            self.new_namespaces.extend(derived)
        return nsx


def _plain_extra(ev: BlockStored, extra: Any) -> bool:
    """A later block's extra keys may only repeat the LoRA name."""
    if not extra:
        return True
    return list(extra) == [ev.lora_name] if ev.lora_name else False
