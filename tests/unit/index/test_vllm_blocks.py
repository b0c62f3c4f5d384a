"""vLLM blocks -> canonical chunk keys (index/ingest/vllm_blocks.py), against the key spec and a
model of vLLM's block pool."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, prompt_keys, salt_digest
from kvtier.index.api import ChunkOp
from kvtier.index.ingest.vllm_blocks import BlockMapper
from kvtier.index.ingest.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.store.api.events import EventKind


def namespace(chunk_tokens: int = 16, **kw) -> Namespace:
    return Namespace(
        model="m", dtype="bf16", num_layers=2, num_kv_heads=2, head_size=32,
        chunk_tokens=chunk_tokens, **kw,
    )  # fmt: skip


def block_hash(parent, tokens, as_bytes: bool = False, salt: str = ""):
    digest = hashlib.sha256(repr((parent, tuple(tokens), salt)).encode()).digest()
    return digest if as_bytes else int.from_bytes(digest[:8], "big")


def stored_event(tokens, bs, parent=None, first=0, medium="GPU", as_bytes=False, **kw):
    """BlockStored for blocks [first, len/bs) of tokens, hashes chained like vLLM's."""
    hashes, h = [], parent
    for i in range(first, len(tokens) // bs):
        h = block_hash(h, tokens[i * bs : (i + 1) * bs], as_bytes, kw.pop("salt_hash", ""))
        hashes.append(h)
    ev = BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens[first * bs :]),
        block_size=bs, lora_id=None, medium=medium, lora_name=kw.pop("lora_name", None), **kw,
    )  # fmt: skip
    return ev, hashes


def prompt_hashes(tokens, bs, as_bytes=False):
    out, h = [], None
    for i in range(len(tokens) // bs):
        h = block_hash(h, tokens[i * bs : (i + 1) * bs], as_bytes)
        out.append(h)
    return out


def keys_of(ops: list[ChunkOp], kind=EventKind.STORED, tier=Tier.GPU) -> list[bytes]:
    return [k for op in ops if op.kind is kind and op.tier is tier for k in op.keys]


@pytest.mark.parametrize(("bs", "chunk"), [(4, 16), (16, 16), (64, 16), (16, 256), (32, 256)])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_keys_match_the_spec(bs: int, chunk: int, as_bytes: bool) -> None:
    ns = namespace(chunk)
    tokens = [random.Random(bs).randrange(50_000) for _ in range(5 * max(bs, chunk) + bs)]
    mapper = BlockMapper([ns])
    # one request arriving in three steps (chunked prefill), as vLLM publishes them
    n_blocks = len(tokens) // bs
    cuts = [0, n_blocks // 3, 2 * n_blocks // 3, n_blocks]
    parent, got = None, []
    for a, b in itertools.pairwise(cuts):
        ev, hashes = stored_event(tokens[: b * bs], bs, parent, first=a, as_bytes=as_bytes)
        mapper.stored(ev)
        got += keys_of(mapper.take_ops())
        parent = hashes[-1] if hashes else parent
    assert got == prompt_keys(ns, tokens[: n_blocks * bs])
    assert not mapper.counts["opaque"] and mapper.blocks == n_blocks


def test_removing_any_block_of_a_chunk_removes_the_chunk() -> None:
    ns, bs = namespace(16), 4
    tokens = list(range(100, 164))  # 4 chunks of 4 blocks
    keys = prompt_keys(ns, tokens)
    hashes = prompt_hashes(tokens, bs)
    mapper = BlockMapper([ns])
    mapper.stored(stored_event(tokens, bs)[0])
    mapper.take_ops()
    mapper.removed(BlockRemoved(block_hashes=[hashes[5]], medium="GPU"))  # middle of chunk 1
    assert keys_of(mapper.take_ops(), EventKind.REMOVED) == [keys[1]]
    mapper.removed(BlockRemoved(block_hashes=[hashes[4], hashes[7]], medium="GPU"))
    assert mapper.take_ops() == []  # chunk 1 was already gone
    # vLLM recomputes the prefix: blocks 4..15 stored again (12 and 13.. are duplicates)
    ev, _ = stored_event(tokens, bs, parent=hashes[3], first=4)
    mapper.stored(ev)
    assert keys_of(mapper.take_ops()) == [keys[1]]
    assert sorted(mapper.holdings()[Tier.GPU][ns.root_key()]) == sorted(keys)
    # blocks 8..15 are now held twice: one copy evicted leaves the chunks held
    mapper.removed(BlockRemoved(block_hashes=hashes[8:], medium="GPU"))
    assert mapper.take_ops() == []
    mapper.removed(BlockRemoved(block_hashes=[hashes[15]], medium="GPU"))
    assert keys_of(mapper.take_ops(), EventKind.REMOVED) == [keys[3]]


def test_first_block_of_a_chunk_evicted_and_recomputed() -> None:
    ns, bs = namespace(16), 4
    tokens = list(range(500, 532))
    keys, hashes = prompt_keys(ns, tokens), prompt_hashes(tokens, bs)
    mapper = BlockMapper([ns])
    mapper.stored(stored_event(tokens, bs)[0])
    mapper.take_ops()
    mapper.removed(BlockRemoved(block_hashes=[hashes[4]], medium="GPU"))
    assert keys_of(mapper.take_ops(), EventKind.REMOVED) == [keys[1]]
    ev = BlockStored(
        block_hashes=[hashes[4]], parent_block_hash=hashes[3], token_ids=tokens[16:20],
        block_size=bs, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    mapper.stored(ev)  # only block 4 comes back; 5..7 never left
    assert keys_of(mapper.take_ops()) == [keys[1]]


def test_all_blocks_cleared_and_other_media() -> None:
    ns, bs = namespace(16), 8
    tokens = list(range(48))
    keys, hashes = prompt_keys(ns, tokens), prompt_hashes(tokens, bs)
    mapper = BlockMapper([ns])
    mapper.stored(stored_event(tokens, bs)[0])
    # an offloading tier reports copies in CPU memory without token ids
    cpu = BlockStored(
        block_hashes=[*hashes[:4], 12345], parent_block_hash=None, token_ids=[], block_size=0,
        lora_id=None, medium="CPU", lora_name=None,
    )  # fmt: skip
    mapper.stored(cpu)
    ops = mapper.take_ops()
    assert keys_of(ops) == keys and keys_of(ops, tier=Tier.CPU) == keys[:2]
    assert mapper.counts["unknown_hash"] == 1
    mapper.feed([AllBlocksCleared()])
    assert mapper.take_ops() == [ChunkOp(EventKind.CLEARED, Tier.GPU)]
    assert mapper.holdings() == {Tier.CPU: {ns.root_key(): keys[:2]}}
    assert mapper.blocks == 4  # the GPU-only blocks are forgotten
    mapper.removed(BlockRemoved(block_hashes=[hashes[3]], medium="CPU"))
    assert keys_of(mapper.take_ops(), EventKind.REMOVED, Tier.CPU) == [keys[1]]
    mapper.stored(stored_event(tokens, bs, medium="STORAGE")[0])
    assert keys_of(mapper.take_ops(), tier=Tier.DISK) == keys


def test_cache_salt_selects_a_derived_namespace_and_lora_blocks_stay_unknown() -> None:
    ns, bs = namespace(16), 8
    tokens = list(range(1000, 1032))
    mapper = BlockMapper([ns])
    n = len(tokens) // bs
    ev, _ = stored_event(tokens, bs, salt_hash="s1", extra_keys=[("tenant\na",)] + [None] * (n - 1))
    mapper.stored(ev)
    derived = ns.model_copy(update={"cache_salt": salt_digest("tenant\na")})
    (op,) = mapper.take_ops()
    assert op.ns_id == derived.root_key() and list(op.keys) == prompt_keys(derived, tokens)
    assert mapper.new_namespaces == [derived]
    # the same tokens without salt: the base namespace
    mapper.stored(stored_event(tokens, bs)[0])
    (op,) = mapper.take_ops()
    assert op.ns_id == ns.root_key()
    # a LoRA's namespace names its weights, which events do not carry: nothing is indexed
    lora_tokens = list(range(2000, 2032))
    ev, _ = stored_event(lora_tokens, bs, lora_name="sql", extra_keys=[("sql",)] * n)
    mapper.stored(ev)
    assert mapper.take_ops() == []


def test_opaque_blocks_map_to_nothing() -> None:
    ns, bs = namespace(16), 8
    tokens = list(range(64))
    mapper = BlockMapper([ns])
    # multimodal placeholders: KV depends on the image, not the token ids
    ev, hashes = stored_event(tokens, bs, extra_keys=[[["mm-hash", 0]]] + [None] * 7)
    mapper.stored(ev)
    assert mapper.take_ops() == [] and mapper.counts["opaque"] == 8
    # blocks whose parent the index never saw (stored before it listened)
    ev, _ = stored_event(tokens, bs, parent=999, first=0)
    mapper.stored(ev)
    assert mapper.take_ops() == [] and mapper.counts["unknown_parent"] == 1
    # removals of opaque blocks are fine
    mapper.removed(BlockRemoved(block_hashes=hashes, medium="GPU"))
    assert mapper.take_ops() == []
    # block size that does not divide the chunk: unaligned blocks are opaque
    odd = BlockMapper([namespace(16)])
    odd.stored(stored_event(list(range(48)), 12)[0])
    assert odd.take_ops() == [] and odd.counts["unaligned"] >= 1
    # other KV cache groups (sliding window) are not followed
    other = BlockMapper([ns])
    ev, _ = stored_event(tokens, bs, group_idx=1, kv_cache_spec_kind="sliding_window")
    other.stored(ev)
    assert other.take_ops() == [] and other.counts["other_group"] == 8
    # malformed: token count does not match the blocks
    ev, _ = stored_event(tokens, bs)
    ev.token_ids = ev.token_ids[:-1]
    other.stored(ev)
    assert other.counts["malformed"] == 1


def test_several_namespaces_per_instance() -> None:
    ranks = [namespace(16, tp_rank=r, tp_size=2) for r in range(2)]
    tokens = list(range(32))
    mapper = BlockMapper(ranks)
    mapper.stored(stored_event(tokens, 8)[0])
    ops = mapper.take_ops()
    assert {op.ns_id: list(op.keys) for op in ops} == {
        ns.root_key(): prompt_keys(ns, tokens) for ns in ranks
    }
    with pytest.raises(ValueError):
        BlockMapper([namespace(16), namespace(32)])


# -- a model of vLLM's block pool ---------------------------------------------------------------


class Pool:
    """Blocks cached per medium (with duplicate copies), what vLLM's events describe."""

    def __init__(self, bs: int, as_bytes: bool) -> None:
        self.bs, self.as_bytes = bs, as_bytes
        self.info: dict = {}  # hash -> (parent, tokens of the whole prefix)
        self.count = [Counter(), Counter(), Counter()]  # GPU, CPU, DISK copies

    def request(self, tokens: list[int], dup: bool) -> BlockStored | None:
        """A prompt: reuse the cached GPU prefix, compute (store) the rest."""
        hashes = prompt_hashes(tokens, self.bs, self.as_bytes)
        first = 0
        while first < len(hashes) and self.count[0][hashes[first]] and not (dup and first > 0):
            first += 1
        if first == len(hashes):
            return None
        for i in range(first, len(hashes)):
            self.info[hashes[i]] = (hashes[i - 1] if i else None, tokens[: (i + 1) * self.bs])
            self.count[0][hashes[i]] += 1
        parent = hashes[first - 1] if first else None
        usable = tokens[: len(hashes) * self.bs]
        ev, got = stored_event(usable, self.bs, parent, first, as_bytes=self.as_bytes)
        assert got == hashes[first:]
        return ev

    def expected(self, ns: Namespace) -> dict[Tier, set[bytes]]:
        C, out = ns.chunk_tokens, {}
        for m, tier in enumerate((Tier.GPU, Tier.CPU, Tier.DISK)):
            held = set()
            for h, (_, prefix) in self.info.items():
                end = len(prefix)
                for z in range(C, end + 1, C):
                    if z <= end - self.bs:
                        continue  # that chunk ends in an earlier block
                    # every block covering [z - C, z) on this path must be held in m
                    cur, ok = h, True
                    while True:
                        if cur not in self.info or not self.count[m][cur]:
                            ok = False
                            break
                        parent, pre = self.info[cur]
                        if len(pre) - self.bs <= z - C:  # this block starts the chunk
                            break
                        cur = parent
                    if ok:
                        held.add(prompt_keys(ns, prefix[:z])[-1])
            out[tier] = held
        return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    geometry=st.sampled_from([(4, 16), (8, 16), (16, 16), (32, 16)]),
    as_bytes=st.booleans(),
)
def test_matches_a_model_of_the_block_pool(seed: int, geometry, as_bytes: bool) -> None:
    bs, C = geometry
    rng = random.Random(seed)
    ns = namespace(C)
    pool, mapper = Pool(bs, as_bytes), BlockMapper([ns])
    index: dict[Tier, set[bytes]] = {Tier.GPU: set(), Tier.CPU: set(), Tier.DISK: set()}
    # prompts share prefixes that end inside chunks, so requests branch within windows
    stems = [[rng.randrange(40) for _ in range(rng.randrange(1, 6 * C))] for _ in range(3)]
    for _step in range(120):
        action = rng.random()
        if action < 0.45:
            stem = rng.choice(stems)
            tokens = stem + [rng.randrange(40) for _ in range(rng.randrange(0, 3 * C))]
            ev = pool.request(tokens, dup=rng.random() < 0.15)
            if ev is not None:
                mapper.stored(ev)
        elif action < 0.75:
            cached = [h for h, n in pool.count[0].items() if n]
            if cached:
                victims = rng.sample(cached, min(len(cached), rng.randrange(1, 4)))
                for h in victims:
                    pool.count[0][h] -= 1
                mapper.removed(BlockRemoved(block_hashes=victims, medium="GPU"))
        elif action < 0.87:
            m, medium = rng.choice([(1, "CPU"), (2, "STORAGE")])
            if rng.random() < 0.6:  # offload copies of GPU blocks, no token ids
                live = [h for h, n in pool.count[0].items() if n]
                chosen = rng.sample(live, min(len(live), 3))
                for h in chosen:
                    pool.count[m][h] += 1
                mapper.stored(BlockStored(block_hashes=chosen, parent_block_hash=None,
                                          token_ids=[], block_size=0, lora_id=None,
                                          medium=medium, lora_name=None))  # fmt: skip
            else:
                held = [h for h, n in pool.count[m].items() if n]
                chosen = rng.sample(held, min(len(held), 2))
                for h in chosen:
                    pool.count[m][h] -= 1
                mapper.removed(BlockRemoved(block_hashes=chosen, medium=medium))
        elif action < 0.9:
            pool.count[0].clear()
            mapper.cleared()
        else:
            continue
        for h in [h for h in pool.info if not any(c[h] for c in pool.count)]:
            del pool.info[h]  # forgotten by the pool: the mapper forgets it too
        for op in mapper.take_ops():
            if op.kind is EventKind.CLEARED:
                index[op.tier].clear()
            elif op.kind is EventKind.STORED:
                index[op.tier].update(op.keys)
            else:
                index[op.tier].difference_update(op.keys)
        expected = pool.expected(ns)
        assert index == expected
    holdings = mapper.holdings()
    assert {t: set(holdings.get(t, {}).get(ns.root_key(), [])) for t in index} == index
