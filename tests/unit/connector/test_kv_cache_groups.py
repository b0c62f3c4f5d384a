"""Models with several KV cache groups (vLLM's hybrid memory allocator) and the kinds kvtier
refuses: what a chunk keeps per group, which blocks a save and a load move, and the start-up
refusals with their reasons. vLLM's own spec classes; no engine."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvtier.connector.group_blocks import (
    UnfillableBlocks,
    chunk_save_blocks,
    lacks_state_only,
    load_blocks,
    real_blocks,
    save_blocks,
)
from kvtier.connector.layout import (
    FULL,
    LOCAL,
    MAMBA,
    SLIDING_WINDOW,
    GroupGeometry,
    KvGeometry,
    ModelIdentity,
    UnsupportedModel,
    check_parallelism,
    chunk_tokens_for,
    describe,
)
from kvtier.connector.metadata import ChunkCopy
from kvtier.connector.paged_kv import PagedKV, PoolView, UnsupportedLayout, state_page_rows
from kvtier.connector.saves import WINDOW_SAVE_WAIT_S, save_wait
from kvtier.core.config.connector import ConnectorConfig
from kvtier.store.client.shm import SharedSegment
from kvtier.testing.models import make_tiny_llama

BLOCK = 32
PAGE = 2 * 2 * BLOCK * 8 * 4  # [K|V, heads, tokens, head_dim] fp32
NULL = 0


def kv_cache_config(*specs_and_layers: tuple[object, list[str]]):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(layers, spec) for spec, layers in specs_and_layers]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def attention(kind: str, **extra: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cls = {"full": FullAttentionSpec, "swa": SlidingWindowSpec}[kind]
    return cls(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32, **extra)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    from vllm.config import ModelConfig, VllmConfig

    model = make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    return VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32"))


def hybrid_geometry(chunk: int = 256, window: int = 64) -> KvGeometry:
    """Sliding window 64 over 32-token blocks: a hit needs the last 2 blocks of a chunk."""
    bpc = chunk // BLOCK
    kept = min(bpc, -(-(window - 1) // BLOCK))
    groups = (
        GroupGeometry(FULL, ("full.0", "full.1"), bpc, source=0),
        GroupGeometry(SLIDING_WINDOW, ("swa.0",), kept, window, source=1),
    )
    return KvGeometry(("full.0", "full.1", "swa.0"), BLOCK, PAGE, chunk, "t", groups)


def test_a_hybrid_chunk_keeps_every_full_block_and_the_window_tail(vllm_config) -> None:
    config = kv_cache_config(
        (attention("full"), ["l1", "l3"]), (attention("swa", sliding_window=64), ["l0", "l2"])
    )
    geometry, _ = describe(vllm_config, config, 256, fingerprint=False)
    assert [g.kind for g in geometry.groups] == [FULL, SLIDING_WINDOW]
    assert [g.kept_blocks for g in geometry.groups] == [8, 2]
    assert geometry.layer_names == ("l1", "l3", "l0", "l2")
    assert geometry.chunk_bytes == (2 * 8 + 2 * 2) * PAGE
    assert [geometry.layer_offset(i) for i in range(4)] == [0, 8 * PAGE, 16 * PAGE, 18 * PAGE]
    assert geometry.hits_on_chunk_boundaries
    # a hybrid model's chunks never share a namespace with a pure model's
    assert geometry.kv_layout.endswith(";groups=full/keep8*2,swa64/keep2*2")
    pure, _ = describe(
        vllm_config, kv_cache_config((attention("full"), ["l0"])), 256, fingerprint=False
    )
    assert "groups=" not in pure.kv_layout and pure.uniform


def test_a_window_longer_than_a_chunk_keeps_the_whole_chunk(vllm_config) -> None:
    config = kv_cache_config(
        (attention("full"), ["l1"]), (attention("swa", sliding_window=512), ["l0"])
    )
    geometry, _ = describe(vllm_config, config, 256, fingerprint=False)
    assert [g.kept_blocks for g in geometry.groups] == [8, 8]
    assert not geometry.hits_on_chunk_boundaries
    # but the window still frees the blocks it passed: a late save checks they are the
    # request's (vLLM may have given them to another request), and steps wait for pool space
    assert not geometry.blocks_stay
    assert save_wait(ConnectorConfig(), geometry) == WINDOW_SAVE_WAIT_S


def test_chunks_follow_the_model_block_size() -> None:
    assert chunk_tokens_for(256, 32) == 256
    assert chunk_tokens_for(256, 384) == 384  # a Mamba hybrid's attention blocks
    assert chunk_tokens_for(500, 32) == 512


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("mamba", "Mamba / linear-attention state only with mamba_cache_mode='align'"),
        ("chunked", "a multiple or a divisor of its attention_chunk_size"),
    ],
)
def test_unsupported_kinds_are_refused_with_the_reason(spec: str, reason: str) -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    if spec == "mamba":
        group = MambaSpec(
            block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,), mamba_type="mamba2"
        )
    else:
        group = ChunkedLocalAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float32,
            attention_chunk_size=96,  # neither divides nor is divided by a 256-token chunk
        )
    config = kv_cache_config((attention("full"), ["l0"]), (group, ["l1"]))
    with pytest.raises(UnsupportedModel, match=reason):
        describe(None, config, 256, fingerprint=False)  # type: ignore[arg-type]


def local(span: int):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32,
        attention_chunk_size=span,
    )  # fmt: skip


@pytest.mark.parametrize(("span", "kept"), [(128, 0), (256, 0), (512, 8), (8192, 8)])
def test_a_chunked_local_group_keeps_what_a_hit_at_a_chunk_boundary_needs(
    vllm_config, span: int, kept: int
) -> None:
    """Llama 4 geometry: a hit at a chunk boundary that starts a local span needs none of the
    local layers' KV; inside a span it needs every block since the span began, so each chunk
    keeps all of its own."""
    config = kv_cache_config((local(span), ["l0", "l1", "l2"]), (attention("full"), ["l3"]))
    geometry, _ = describe(vllm_config, config, 256, fingerprint=False)
    assert [(g.kind, g.kept_blocks) for g in geometry.groups] == [(LOCAL, kept), (FULL, 8)]
    assert geometry.chunk_bytes == (3 * kept + 8) * PAGE
    assert geometry.kv_layout.endswith(f";groups=local{span}/keep{kept}*3,full/keep8*1")
    assert geometry.hits_on_chunk_boundaries == (kept == 0)
    assert not geometry.blocks_stay  # vLLM frees a passed span's blocks mid-request


def test_local_layers_merged_into_a_full_group_are_stored_as_full_attention(vllm_config) -> None:
    """With the hybrid allocator off, vLLM puts every layer in one full group whose spec
    names the span, and keeps every block: a chunk is a plain full-attention chunk."""
    config = kv_cache_config((attention("full", attention_chunk_size=128), ["l0", "l1"]))
    geometry, _ = describe(vllm_config, config, 256, fingerprint=False)
    assert [(g.kind, g.kept_blocks) for g in geometry.groups] == [(FULL, 8)]
    assert geometry.blocks_stay


def mamba(**extra: object):
    """A Mamba group whose (padded) page is the attention groups' page, as vLLM sizes it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK,
        shapes=((PAGE // 8,),),
        dtypes=(torch.float32,),
        page_size_padded=PAGE,
        mamba_type="gdn_attention",
        **({"mamba_cache_mode": "align"} | extra),  # type: ignore[arg-type]
    )


def test_a_mamba_hybrid_chunk_keeps_the_state_after_its_last_token(vllm_config) -> None:
    config = kv_cache_config((mamba(), ["l0", "l2"]), (attention("full"), ["l1"]))
    geometry, identity = describe(vllm_config, config, 256, fingerprint=False)
    # the state last, whatever vLLM's group order: a chunk's attention is its first bytes
    assert [(g.kind, g.source) for g in geometry.groups] == [(FULL, 1), (MAMBA, 0)]
    assert [g.kept_blocks for g in geometry.groups] == [8, 1]
    assert geometry.chunk_bytes == (8 + 2 * 1) * PAGE
    assert geometry.has_state and geometry.attention_bytes == 8 * PAGE
    assert geometry.kv_layout.endswith(";groups=full/keep8*1,mamba/keep1*2;state-last")
    assert geometry.hits_on_chunk_boundaries
    assert (identity.num_kv_heads, identity.head_size) == (2, 8)  # the attention group's
    # the sibling namespace of chunks without state: other bytes, so another namespace
    whole, alone = identity.namespace(geometry, 0), identity.namespace(geometry, 0, "", "", True)
    assert alone.kv_layout == whole.kv_layout + ";attention-only"
    assert alone.root_key() != whole.root_key()
    # block i holds the state after (i + 1) * 32 tokens; vLLM leaves the null block where it
    # wrote none (a step that ran past the boundary): that chunk is saved as its attention
    full = list(range(100, 116))
    state = [NULL] * 7 + [11] + [NULL] * 7 + [NULL]
    blocks = (state, full)  # vLLM's tables, by its group index (GroupGeometry.source)
    assert chunk_save_blocks(geometry, blocks, 0, NULL) == [(0, tuple(full[:8])), (1, (11,))]
    assert save_blocks(geometry, blocks, 0, NULL) == ([(0, tuple(full[:8])), (1, (11,))], False)
    assert chunk_save_blocks(geometry, blocks, 1, NULL) is None
    assert lacks_state_only(geometry, blocks, 1, NULL)
    assert save_blocks(geometry, blocks, 1, NULL) == ([(0, tuple(full[8:]))], True)
    assert not lacks_state_only(geometry, (state, full[:12]), 1, NULL)  # attention missing
    assert save_blocks(geometry, (state, full[:12]), 1, NULL) is None
    # a load of 2 chunks fills the state at its end (vLLM allocated that one block) and
    # every attention block
    table = [NULL] * 15 + [42]
    got = load_blocks(geometry, (table, full), 0, 16, NULL)
    assert [(g, b, within) for g, b, within, _ in got if g == 1] == [(1, 15, 0)]
    assert len([1 for g, *_ in got if g == 0]) == 16


def test_groups_out_of_the_state_last_order_are_refused() -> None:
    groups = (GroupGeometry(MAMBA, ("l0",), 1), GroupGeometry(FULL, ("l1",), 8))
    with pytest.raises(ValueError, match="Mamba groups come last"):
        KvGeometry(("l0", "l1"), 32, PAGE, 256, "x", groups)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"mamba_cache_mode": "all"}, "only with mamba_cache_mode='align'"),
        ({"num_speculative_blocks": 1}, "speculative decoding"),
        ({"num_prefill_checkpoint_blocks": 1}, "prefill checkpoint blocks"),
    ],
)
def test_mamba_state_kvtier_cannot_place_is_refused(vllm_config, extra, reason) -> None:
    config = kv_cache_config((mamba(**extra), ["l0"]), (attention("full"), ["l1"]))
    with pytest.raises(UnsupportedModel, match=reason):
        describe(vllm_config, config, 256, fingerprint=False)


def test_a_model_of_mamba_layers_only_is_refused(vllm_config) -> None:
    with pytest.raises(UnsupportedModel, match="no attention layers"):
        describe(vllm_config, kv_cache_config((mamba(), ["l0"])), 256, fingerprint=False)


def test_a_mamba_layers_state_views_become_whole_padded_pages() -> None:
    """vLLM registers a Mamba layer as views (conv, SSM state) into one allocation, a padded
    page per block: kvtier copies the page whole."""
    blocks, page = 4, 64
    raw = torch.zeros(blocks * page, dtype=torch.uint8)
    conv = torch.as_strided(raw, (blocks, 10), (page, 1), 0)
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 5), (page // 4, 1), 4)
    rows = state_page_rows([conv, ssm], page)
    assert rows.shape == (blocks, page)
    rows[2].fill_(7)
    assert bool((raw[2 * page : 3 * page] == 7).all()) and int(raw[: 2 * page].sum()) == 0
    assert float(ssm[2, 0]) != 0.0  # the same memory
    assert state_page_rows([conv], page).data_ptr() == rows.data_ptr()
    with pytest.raises(UnsupportedLayout, match="one 64-byte page per block"):
        state_page_rows([torch.as_strided(raw, (blocks, 10), (page // 2, 1), 0)], page)
    with pytest.raises(UnsupportedLayout, match="one 64-byte page per block"):
        state_page_rows([conv, torch.as_strided(raw, (blocks - 1, 10), (page, 1), page - 4)], page)


def test_mla_is_stored_once_for_every_rank() -> None:
    geometry = KvGeometry(("l0",), BLOCK, PAGE, 256, "t", replicated=True)
    identity = ModelIdentity("m", "", "bfloat16", 1, 576, tp_size=8, pp_size=1)
    assert list(identity.data_ranks(geometry)) == [0]
    ns = identity.namespace(geometry, 0)
    assert (ns.tp_rank, ns.tp_size) == (0, 8)  # one copy, of what a TP-8 instance computed
    tp1 = ModelIdentity("m", "", "bfloat16", 1, 576, tp_size=1, pp_size=1)
    # a TP-1 instance computes other bytes (its matmuls sum in another order than TP-8's
    # all-reduces): it never reads a TP-8 instance's chunks
    assert ns != tp1.namespace(geometry, 0)
    plain = KvGeometry(("l0",), BLOCK, PAGE, 256, "t")
    assert list(identity.data_ranks(plain)) == list(range(8))
    assert identity.namespace(plain, 3).tp_rank == 3


# -- which blocks a save and a load move ---------------------------------------------------


def test_a_save_copies_each_group_kept_blocks() -> None:
    geo = hybrid_geometry()
    full = list(range(100, 124))  # 3 chunks of 8 blocks
    swa = [NULL] * 12 + list(range(200, 212))  # the window passed the first 12 blocks
    blocks = (full, swa)
    assert chunk_save_blocks(geo, blocks, 2, NULL) == [
        (0, tuple(range(116, 124))),
        (1, (210, 211)),
    ]
    assert chunk_save_blocks(geo, blocks, 1, NULL) == [(0, tuple(range(108, 116))), (1, (202, 203))]
    # chunk 0's tail (blocks 6, 7) was freed: it cannot be saved whole
    assert chunk_save_blocks(geo, blocks, 0, NULL) is None
    # nor a chunk not allocated yet
    assert chunk_save_blocks(geo, blocks, 3, NULL) is None


def test_a_load_fills_the_full_blocks_and_the_window() -> None:
    geo = hybrid_geometry()
    # a 512-token hit, vLLM's tables as allocate_external_computed_blocks leaves them: every
    # full block, and the sliding window's last 2 blocks real (the rest null)
    full = list(range(100, 116))
    swa = [NULL] * 14 + [214, 215]
    targets = load_blocks(geo, (full, swa), 0, 16, NULL)
    assert [t for t in targets if t[0] == 0] == [(0, b, b % 8, 100 + b) for b in range(16)]
    assert [t for t in targets if t[0] == 1] == [(1, 14, 0, 214), (1, 15, 1, 215)]
    assert real_blocks(geo, (full, swa), 0, 16, NULL) == [*full, 214, 215]
    # a real block vLLM expects filled that no chunk keeps: the load must fail, not skip it
    with pytest.raises(UnfillableBlocks):
        load_blocks(geo, (full, [NULL] * 12 + [212, 213, 214, 215]), 0, 16, NULL)


@pytest.fixture
def segment():
    seg = SharedSegment.create(f"kvtier-test-groups-{os.getpid()}", 1 << 20)
    try:
        yield seg
    finally:
        seg.close()
        seg.unlink()


def test_group_pages_round_trip_through_the_pool(segment: SharedSegment) -> None:
    """Each layer copies its own group's blocks into its own place in the chunk."""
    geo = hybrid_geometry(chunk=128)  # 4 blocks; the window keeps the last 2
    gen = torch.Generator().manual_seed(1)
    shape = (32, 2, 2, BLOCK, 8)
    source = {n: torch.randn(*shape, generator=gen) for n in geo.layer_names}
    target = {n: torch.zeros(*shape) for n in geo.layer_names}
    pool = PoolView(segment, pin=False)
    extents = ((4096, geo.chunk_bytes),)
    saves = [
        ChunkCopy(extents, 0, 0, (1, 2, 3, 4), b"k", 0),
        ChunkCopy(extents, 0, 0, (9, 8), b"k", 1),
    ]
    saver, loader = PagedKV(source, geo), PagedKV(target, geo)
    plan = saver.plan(saves)
    for layer in range(geo.num_layers):
        saver.save_layer(layer, pool, plan)
    loads = [
        ChunkCopy(extents, 0, 0, (11, 12, 13, 14), b"k", 0),
        ChunkCopy(extents, 0, 0, (20, 21), b"k", 1),
    ]
    plan = loader.plan(loads)
    for layer in range(geo.num_layers):
        loader.load_layer(layer, pool, plan)
    for name in ("full.0", "full.1"):
        assert torch.equal(target[name][11:15], source[name][1:5])
    assert torch.equal(target["swa.0"][20], source["swa.0"][9])
    assert torch.equal(target["swa.0"][21], source["swa.0"][8])
    # nothing else written: the full layers' blocks 20, 21 and the window layer's 11..14
    assert not target["full.0"][20:22].any() and not target["swa.0"][11:15].any()


# -- parallel layouts ------------------------------------------------------------------------


def parallel(pp: int = 1, dcp: int = 1, pcp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline_parallel_size=pp,
        decode_context_parallel_size=dcp,
        prefill_context_parallel_size=pcp,
    )


def test_pipeline_stages_must_hold_equal_layers() -> None:
    check_parallelism(parallel(pp=2), num_layers=4)
    with pytest.raises(UnsupportedModel, match=r"split \[2, 1\]"):
        check_parallelism(parallel(pp=2), num_layers=3)


@pytest.mark.parametrize("layout", [{"dcp": 2}, {"pcp": 2}])
def test_context_parallelism_is_refused_with_the_reason(layout: dict[str, int]) -> None:
    with pytest.raises(UnsupportedModel, match="context parallelism"):
        check_parallelism(parallel(**layout), num_layers=4)


def test_data_ranks_are_stage_major() -> None:
    """TP 2 x PP 2: four ranks' chunks, each namespace naming its stage and TP rank."""
    identity = ModelIdentity("m", "", "bfloat16", 2, 64, tp_size=2, pp_size=2)
    geometry = KvGeometry(("l0",), BLOCK, PAGE, 256, "t")
    assert list(identity.data_ranks(geometry)) == [0, 1, 2, 3]
    assert identity.data_rank(geometry, tp_rank=1, pp_rank=1) == 3
    ns = identity.namespace(geometry, 3)
    assert (ns.tp_rank, ns.tp_size, ns.pp_rank, ns.pp_size) == (1, 2, 1, 2)
    mla = KvGeometry(("l0",), BLOCK, PAGE, 256, "t", replicated=True)
    assert list(identity.data_ranks(mla)) == [0, 1]  # one copy per stage
    assert identity.data_rank(mla, tp_rank=1, pp_rank=1) == 1
