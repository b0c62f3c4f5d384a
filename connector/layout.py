"""How a vLLM instance's paged KV maps onto kvtier chunks, and which namespace it belongs to.

vLLM stores KV in pages: one page per (layer, block) of ``block_size`` tokens, whose interior
depends on the platform and attention backend (CPU: K transposed then V per head; CUDA
FlashAttention: [token, head, K|V]). kvtier treats a page as opaque bytes, so a chunk is:

    chunk (kv_layout "kvtier-pages-v2"):  for group:  for layer in group:  kept page bytes

A model's layers come in KV cache groups (vLLM's hybrid memory allocator): one per attention
kind. A chunk keeps, per group, exactly what a prefix hit at any chunk boundary needs
(docs/keys/spec.md, "KV cache groups"):

- full attention (MLA included): every block of the chunk;
- sliding window ``w``: the chunk's last ``min(blocks_per_chunk, ceil((w - 1) / block_size))``
  blocks, the only ones vLLM keeps (and attends to) for tokens after the boundary;
- chunked local attention of span ``a`` (Llama 4: a token attends to the tokens of its
  ``a``-aligned span before it): none of a chunk's blocks when ``a`` divides the chunk (a hit
  at a chunk boundary starts a span, whose tokens need nothing before it), every block when
  the chunk divides ``a`` (later boundaries of the same span need them); other ratios are
  refused;
- Mamba / linear-attention state (vLLM's ``mamba_cache_mode="align"``): the chunk's last
  block, whose page holds the recurrent state after exactly the chunk's last token (block
  ``i`` holds the state after ``(i + 1) * block_size`` tokens). Mamba groups come last in a
  chunk, so the chunk's first ``attention_bytes`` are its attention KV alone: vLLM writes a
  state only where a prefill step ends, and a chunk without one is stored as those bytes
  alone, in a sibling namespace (``attention_only``; docs/connector.md, "Mamba hybrids").

Other kinds (cross attention, Mamba in other cache modes) are refused at start-up with the
reason (``model_support.py``). A single full-attention group
gives the bytes (and the namespace) of kvtier before groups existed.

Everything that decides a page's bytes goes into the namespace's ``kv_layout`` string
(platform, backend layout, CPU attention ISA, block size, page size, groups), so two
instances share chunks only if their pages are byte-compatible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.connector.fingerprint import model_config_fingerprint, weights_fingerprint
from kvtier.connector.model_support import (
    FULL,
    LOCAL,
    MAMBA,
    SLIDING_WINDOW,
    UnsupportedModel,
    advise_mamba_steps,
    check_parallelism,
    group_kind,
    group_spec,
)
from kvtier.core.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group's share of a chunk: its layers and how many of each chunk's blocks
    they keep (the trailing ``kept_blocks``)."""

    kind: str  # FULL, SLIDING_WINDOW, LOCAL or MAMBA
    layer_names: tuple[str, ...]
    kept_blocks: int
    window_tokens: int = 0  # sliding window or local attention span, in tokens (0: neither)
    source: int = 0  # vLLM's index of the group (its block table in ``get_block_ids()``)

    def label(self) -> str:
        kind = self.kind if self.kind in (FULL, MAMBA) else f"swa{self.window_tokens}"
        if self.kind == LOCAL:
            kind = f"local{self.window_tokens}"
        return f"{kind}/keep{self.kept_blocks}*{len(self.layer_names)}"


@dataclass(frozen=True)
class KvGeometry:
    """Chunk geometry of one instance (identical on the scheduler and every worker).

    ``groups`` default to one full-attention group over ``layer_names``. ``layer_names`` is
    the chunk's layer order: group after group."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int  # one layer's page of one block
    chunk_tokens: int
    kv_layout: str
    groups: tuple[GroupGeometry, ...] = ()
    # MLA: every TP rank holds the same latent KV, so one copy serves them all
    replicated: bool = False
    _offsets: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _layer_group: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = self.groups or (GroupGeometry(FULL, self.layer_names, self.blocks_per_chunk),)
        object.__setattr__(self, "groups", groups)
        names = tuple(n for g in groups for n in g.layer_names)
        if names != self.layer_names:
            raise ValueError("layer_names must list the groups' layers, group after group")
        kinds = [g.kind == MAMBA for g in groups]
        if kinds != sorted(kinds):
            raise ValueError("Mamba groups come last in a chunk (attention_bytes)")
        offsets, layer_group, at = [], [], 0
        for index, group in enumerate(groups):
            for _ in group.layer_names:
                offsets.append(at)
                layer_group.append(index)
                at += group.kept_blocks * self.page_bytes
        offsets.append(at)
        object.__setattr__(self, "_offsets", tuple(offsets))
        object.__setattr__(self, "_layer_group", tuple(layer_group))

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one full-attention layer inside a chunk."""
        return self.blocks_per_chunk * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self._offsets[-1]

    @property
    def has_state(self) -> bool:
        """Some group keeps recurrent state (Mamba / linear attention), stored last."""
        return any(g.kind == MAMBA for g in self.groups)

    @property
    def attention_bytes(self) -> int:
        """Where the state's layers start in a chunk: its bytes before them are every other
        group's (the whole chunk when there is no state). A chunk vLLM wrote no state for is
        stored as these bytes alone."""
        first = next((i for i, g in enumerate(self.groups) if g.kind == MAMBA), None)
        if first is None:
            return self.chunk_bytes
        return self._offsets[sum(len(g.layer_names) for g in self.groups[:first])]

    @property
    def uniform(self) -> bool:
        """Every layer keeps every block of a chunk (one full-attention group's layout)."""
        return all(g.kept_blocks == self.blocks_per_chunk for g in self.groups)

    @property
    def blocks_stay(self) -> bool:
        """vLLM keeps every block of a request's chunks while the request lives: only full
        attention does. A sliding window or a local attention chunk frees the blocks it has
        passed mid-request (``remove_skipped_blocks``), even when a chunk keeps all of them,
        and vLLM may hand them to another request in the same step: a save sent a step late
        must check they are still the request's."""
        return all(g.kind == FULL for g in self.groups)

    @property
    def hits_on_chunk_boundaries(self) -> bool:
        """A hit must end on a chunk boundary: some group keeps only a chunk's tail."""
        return not self.uniform

    def layer_offset(self, layer: int) -> int:
        """Where layer ``layer``'s kept pages start inside a chunk's bytes."""
        return self._offsets[layer]

    def group_of(self, layer: int) -> int:
        return self._layer_group[layer]

    def kept_from(self, group: int) -> int:
        """The first of a chunk's blocks that group ``group`` keeps."""
        return self.blocks_per_chunk - self.groups[group].kept_blocks


@dataclass(frozen=True)
class ModelIdentity:
    """The per-instance half of a namespace; requests add cache_salt and LoRA.

    ``model_config_fp`` and ``weights_fp`` say what the weights *are* (``fingerprint.py``), so
    two instances serving different weights under one name never share chunks; ``tag`` is the
    operator's word for weights changed in place, and ``generation`` counts namespace bumps
    (``reset_prefix_cache`` on a shared store)."""

    model: str
    revision: str
    dtype: str
    num_kv_heads: int
    head_size: int
    tp_size: int
    pp_size: int
    model_config_fp: str = ""
    weights_fp: str = ""
    tag: str = ""
    generation: int = 0

    def namespace(
        self,
        geometry: KvGeometry,
        rank: int,
        salt_digest: str = "",
        lora_fp: str = "",
        attention_only: bool = False,
    ) -> Namespace:
        """The namespace of data rank ``rank`` (``data_ranks``); ``salt_digest``:
        ``kvtier.core.keys.salt_digest(request.cache_salt)``; ``lora_fp``: the adapter's
        weights fingerprint (``AdapterFingerprints``). ``attention_only``: the sibling
        namespace of a model with state (``KvGeometry.has_state``) holding the chunks vLLM
        wrote no state for, as their ``attention_bytes`` alone, under the same chunk keys as
        the namespace of whole chunks (the keys name tokens; the namespace says the bytes)."""
        tag = self.tag if not self.generation else f"{self.tag}#gen={self.generation}"
        per_stage = self.ranks_per_stage(geometry)
        pp_rank, tp_rank = divmod(rank, per_stage)
        return Namespace(
            model=self.model,
            revision=self.revision,
            dtype=self.dtype,
            num_layers=geometry.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            kv_layout=geometry.kv_layout + (";attention-only" if attention_only else ""),
            tp_rank=tp_rank,  # MLA: 0 (one copy of a stage's latent serves every rank)
            # the instance's TP size, MLA's too: TP changes the KV's bytes (a row-parallel
            # layer's all-reduce sums in another order than one rank's matmul), so a chunk a
            # TP-2 instance computed is not what a TP-1 instance computes (docs/keys/spec.md)
            tp_size=self.tp_size,
            pp_rank=pp_rank,
            pp_size=self.pp_size,
            chunk_tokens=geometry.chunk_tokens,
            cache_salt=salt_digest,
            lora=lora_fp,
            model_config_fp=self.model_config_fp,
            weights_fp=self.weights_fp,
            tag=tag,
        )

    def ranks_per_stage(self, geometry: KvGeometry) -> int:
        """TP ranks whose chunks differ: all of them, or one when the KV is replicated."""
        return 1 if geometry.replicated else self.tp_size

    def data_ranks(self, geometry: KvGeometry) -> range:
        """The ranks whose chunks differ, pipeline stage after stage: ``pp_rank *
        ranks_per_stage + tp_rank``. A worker reads and writes its own data rank's chunks
        (``data_rank``); with replicated KV (MLA) every TP rank of a stage shares one."""
        return range(self.ranks_per_stage(geometry) * self.pp_size)

    def data_rank(self, geometry: KvGeometry, tp_rank: int, pp_rank: int) -> int:
        per_stage = self.ranks_per_stage(geometry)
        return pp_rank * per_stage + (0 if geometry.replicated else tp_rank)


def describe(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    chunk_tokens: int,
    model_id: str | None = None,
    weights_tag: str = "",
    fingerprint: bool = True,
) -> tuple[KvGeometry, ModelIdentity]:
    """Geometry and identity of this instance's KV cache. Raises UnsupportedModel, with the
    reason, for KV layouts kvtier cannot chunk (Mamba / linear-attention state, chunked local
    attention, context parallelism, ...). ``chunk_tokens`` is rounded up to a multiple of the
    model's block size (hybrid models get blocks of e.g. 384 tokens). ``fingerprint=False``
    skips reading the weight files."""
    from vllm.platforms import current_platform

    sources = [
        i
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if getattr(g, "enable_kv_transfer", True)
    ]
    groups = [kv_cache_config.kv_cache_groups[i] for i in sources]
    if not groups:
        raise UnsupportedModel("this model has no KV cache kvtier could store")
    specs = [group_spec(g.kv_cache_spec) for g in groups]
    block_sizes = {spec.block_size for spec in specs}
    page_sizes = {spec.page_size_bytes for spec in specs}
    if len(block_sizes) > 1 or len(page_sizes) > 1:
        raise UnsupportedModel(
            f"kvtier needs one block size and page size across KV cache groups, this model "
            f"has block sizes {sorted(block_sizes)} and page sizes {sorted(page_sizes)}"
        )
    kinds = [group_kind(s) for s in specs]
    attention = [s for s, kind in zip(specs, kinds, strict=True) if kind != MAMBA]
    if not attention:
        raise UnsupportedModel(
            "kvtier stores Mamba state beside attention KV, and this model has no attention "
            "layers: serve it without kvtier"
        )
    spec = attention[0]  # names the KV dtype, heads and the attention kernel's page interior
    block_size = spec.block_size
    chunk_tokens = chunk_tokens_for(chunk_tokens, block_size)
    blocks_per_chunk = chunk_tokens // block_size
    group_geometry = tuple(
        sorted(  # state last: a chunk's attention KV is its first bytes (attention_bytes)
            (
                _group_geometry(g.layer_names, s, kind, block_size, blocks_per_chunk, source)
                for g, s, kind, source in zip(groups, specs, kinds, sources, strict=True)
            ),
            key=lambda g: g.kind == MAMBA,
        )
    )
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    dtype = str(spec.dtype).removeprefix("torch.")
    platform = current_platform.device_type
    layout = kv_cache_config.kv_cache_layout or "default"
    isa = _cpu_attention_isa(spec, cache.cache_dtype) if platform == "cpu" else ""
    # Page interiors and numerics also differ between vLLM versions, attention backends and
    # GPU architectures: "auto" picks a backend from exactly those (and the model's shape).
    kv_layout = (
        f"kvtier-pages-v2;vllm;{platform};{layout};{isa};"
        f"bs{block_size};page{spec.page_size_bytes};kvdtype={cache.cache_dtype};"
        f"vllm={_vllm_version()};attn={_attention_backend(vllm_config)};"
        f"arch={_device_arch(current_platform)}"
    )
    plain = len(group_geometry) == 1 and group_geometry[0].kind == FULL
    if not plain:  # a hybrid model's chunk holds other bytes than a pure model's
        kv_layout += ";groups=" + ",".join(g.label() for g in group_geometry)
    if any(g.kind == MAMBA for g in group_geometry):
        kv_layout += ";state-last"  # an earlier layout put the state where vLLM's group was
    geometry = KvGeometry(
        layer_names=tuple(n for g in group_geometry for n in g.layer_names),
        block_size=block_size,
        page_bytes=spec.page_size_bytes,
        chunk_tokens=chunk_tokens,
        kv_layout=kv_layout,
        groups=group_geometry,
        replicated=bool(model.use_mla),
    )
    check_parallelism(
        vllm_config.parallel_config, getattr(model.hf_text_config, "num_hidden_layers", None)
    )
    if any(g.kind == MAMBA for g in group_geometry):
        advise_mamba_steps(vllm_config.scheduler_config.max_num_batched_tokens, chunk_tokens)
    identity = ModelIdentity(
        model=model_id or str(model.model),
        revision=str(model.revision or ""),
        dtype=dtype,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        model_config_fp=model_config_fingerprint(vllm_config),
        weights_fp=weights_fingerprint(str(model.model), model.revision) if fingerprint else "",
        tag=weights_tag,
    )
    return geometry, identity


def chunk_tokens_for(configured: int, block_size: int) -> int:
    """The chunk size an engine uses: the configured one, rounded up to whole blocks of this
    model (a chunk is whole blocks; a hybrid model's blocks may be 384 or 528 tokens)."""
    chunk = -(-configured // block_size) * block_size
    if chunk != configured:
        log.warning(
            "kvtier: chunk_tokens=%d is not a multiple of this model's KV block size (%d "
            "tokens): chunks of %d tokens are used",
            configured,
            block_size,
            chunk,
        )
    return chunk


def _group_geometry(
    layer_names: list[str],
    spec: Any,
    kind: str,
    block_size: int,
    blocks_per_chunk: int,
    source: int,
) -> GroupGeometry:
    if kind == FULL:
        return GroupGeometry(FULL, tuple(layer_names), blocks_per_chunk, source=source)
    if kind == MAMBA:  # the state after the chunk's last token: its last block
        return GroupGeometry(MAMBA, tuple(layer_names), 1, source=source)
    if kind == LOCAL:
        return _local_geometry(layer_names, spec, block_size, blocks_per_chunk, source)
    # vLLM keeps (and a hit at a boundary needs) the blocks of the last window - 1 tokens,
    # plus any it retains for speculative decoding (SlidingWindowManager)
    reach = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
    kept = min(blocks_per_chunk, -(-reach // block_size))
    return GroupGeometry(SLIDING_WINDOW, tuple(layer_names), kept, spec.sliding_window, source)


def _local_geometry(
    layer_names: list[str], spec: Any, block_size: int, blocks_per_chunk: int, source: int
) -> GroupGeometry:
    """Chunked local attention (vLLM's ``ChunkedLocalAttentionManager``): a token at ``t``
    attends to ``[t // a * a, t]``, so a hit ending at ``p`` needs the group's blocks of
    ``[p // a * a, p)`` only. A chunk boundary that is a span boundary needs none; one inside
    a span needs every block since the span began, which the chunks before it keep."""
    span = int(spec.attention_chunk_size)
    chunk = blocks_per_chunk * block_size
    if chunk % span == 0:
        kept = 0
    elif span % chunk == 0:
        kept = blocks_per_chunk
    else:
        raise UnsupportedModel(
            f"kvtier stores chunked local attention when chunk_tokens ({chunk}) is a multiple "
            f"or a divisor of its attention_chunk_size ({span}); set chunk_tokens to one"
        )
    return GroupGeometry(LOCAL, tuple(layer_names), kept, span, source)


def _cpu_attention_isa(spec: Any, cache_dtype: str) -> str:
    """The CPU attention kernel family decides the page interior (AMX packs differently).
    Unknown: named by this CPU's model and flags, so unknown ISAs never share one name."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, cache_dtype)
    except Exception:
        return f"isa-unknown-{_cpu_identity()}"


def _cpu_identity() -> str:
    """16 hex digits over the CPU's model name and feature flags (what decides its kernels)."""
    import hashlib

    wanted = ("model name", "flags", "features", "cpu part", "isa")
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        lines = [platform.processor(), platform.machine()]
    seen = sorted({ln.strip() for ln in lines if ln.split(":")[0].strip().lower() in wanted})
    return hashlib.sha256("\n".join(seen).encode()).hexdigest()[:16]


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def _attention_backend(vllm_config: Any) -> str:
    """The backend the operator chose, or "auto" (chosen from what the namespace already
    holds: vLLM version, device architecture, model shape and dtypes)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return str(getattr(backend, "name", backend) or "auto")


def _device_arch(platform: Any) -> str:
    """A GPU's compute capability (e.g. sm90), '' where there is none (CPU)."""
    try:
        capability = platform.get_device_capability()
    except Exception:
        return "unknown"
    if capability is None:
        return ""
    return f"sm{capability.major}{capability.minor}"
