"""How a vLLM instance's paged KV maps onto kvtier chunks, and which namespace it belongs to.

vLLM stores KV in pages: one page per (layer, block) of ``block_size`` tokens, whose interior
depends on the platform and attention backend (CPU: K transposed then V per head; CUDA
FlashAttention: [token, head, K|V]). kvtier treats a page as opaque bytes, so a chunk is:

    chunk (kv_layout "kvtier-pages-v1"):  for layer in layers:  for block in chunk: page bytes

Everything that decides a page's bytes goes into the namespace's ``kv_layout`` string
(platform, backend layout, CPU attention ISA, block size, page size), so two instances share
chunks only if their pages are byte-compatible.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.connector.fingerprint import model_config_fingerprint, weights_fingerprint
from kvtier.core.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class KvGeometry:
    """Chunk geometry of one instance (identical on the scheduler and every worker)."""

    layer_names: tuple[str, ...]
    block_size: int
    page_bytes: int  # one layer's page of one block
    chunk_tokens: int
    kv_layout: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer inside a chunk."""
        return self.blocks_per_chunk * self.page_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


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
    pp_rank: int
    pp_size: int
    model_config_fp: str = ""
    weights_fp: str = ""
    tag: str = ""
    generation: int = 0

    def namespace(
        self, geometry: KvGeometry, tp_rank: int, salt_digest: str = "", lora_fp: str = ""
    ) -> Namespace:
        """``salt_digest``: ``kvtier.core.keys.salt_digest(request.cache_salt)``; ``lora_fp``: the
        adapter's weights fingerprint (``AdapterFingerprints``)."""
        tag = self.tag if not self.generation else f"{self.tag}#gen={self.generation}"
        return Namespace(
            model=self.model,
            revision=self.revision,
            dtype=self.dtype,
            num_layers=geometry.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            kv_layout=geometry.kv_layout,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            chunk_tokens=geometry.chunk_tokens,
            cache_salt=salt_digest,
            lora=lora_fp,
            model_config_fp=self.model_config_fp,
            weights_fp=self.weights_fp,
            tag=tag,
        )


def describe(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    chunk_tokens: int,
    model_id: str | None = None,
    weights_tag: str = "",
    fingerprint: bool = True,
) -> tuple[KvGeometry, ModelIdentity]:
    """Geometry and identity of this instance's KV cache. Raises UnsupportedModel for KV
    layouts kvtier cannot chunk (several KV cache groups: hybrid/sliding-window models,
    context parallelism). ``fingerprint=False`` skips reading the weight files."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModel(
            f"kvtier supports models with one KV cache group, this one has {len(groups)} "
            "(hybrid or sliding-window attention)"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        raise UnsupportedModel(f"kvtier supports full attention only, not {type(spec).__name__}")
    block_size = spec.block_size
    if chunk_tokens % block_size:
        # checked against the KV cache vLLM allocated, not cache_config.block_size: vLLM may
        # size blocks otherwise (MLA kernels, hybrid models), and a chunk is whole blocks
        raise UnsupportedModel(
            f"chunk_tokens={chunk_tokens} must be a multiple of vLLM's block_size for this "
            f"model's KV cache: set it to a multiple of {block_size}"
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
    geometry = KvGeometry(
        layer_names=tuple(groups[0].layer_names),
        block_size=block_size,
        page_bytes=spec.page_size_bytes,
        chunk_tokens=chunk_tokens,
        kv_layout=kv_layout,
    )
    check_parallelism(vllm_config.parallel_config)
    identity = ModelIdentity(
        model=model_id or str(model.model),
        revision=str(model.revision or ""),
        dtype=dtype,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        pp_rank=0,
        pp_size=1,
        model_config_fp=model_config_fingerprint(vllm_config),
        weights_fp=weights_fingerprint(str(model.model), model.revision) if fingerprint else "",
        tag=weights_tag,
    )
    return geometry, identity


def prefix_reuse_refused(vllm_config: VllmConfig) -> str | None:
    """Why this engine must serve no hits, or None. A hit is exact only where vLLM computes
    exactly over a cached prefix; where vLLM turns its own prefix caching off for a model it
    does not (MLA on CPU: vLLM disables it there, and with it forced on vLLM's own hits
    differ from a recompute too). kvtier then neither loads nor saves for this engine."""
    if vllm_config.cache_config.enable_prefix_caching:
        return None
    model = vllm_config.model_config
    why = " (vLLM turns it off for MLA on this platform)" if model.use_mla else ""
    return (
        f"vLLM's own prefix caching is off for {model.model}{why}: a computation over a "
        "cached prefix is not known to be exact here, so kvtier serves no hits and saves "
        "nothing for this engine"
    )


def check_parallelism(parallel: Any) -> None:
    """Refuse layouts whose blocks do not hold ``block_size`` consecutive tokens of one rank's
    heads: context parallelism (DCP/PCP) spreads a block's tokens over ranks, so a chunk key
    would name KV that no single rank holds."""
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedModel("kvtier does not support pipeline parallelism yet")
    dcp = getattr(parallel, "decode_context_parallel_size", 1) or 1
    pcp = getattr(parallel, "prefill_context_parallel_size", 1) or 1
    if dcp > 1 or pcp > 1:
        raise UnsupportedModel(
            f"kvtier does not support context parallelism (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): with it a KV block holds tokens interleaved "
            "across ranks, which kvtier's chunks cannot name. Run without "
            "--decode-context-parallel-size/--prefill-context-parallel-size, or without kvtier."
        )


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
