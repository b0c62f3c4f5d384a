"""What of a model kvtier can store, and the start-up refusals for the rest, each with its
reason (docs/connector.md, the support matrix).

A KV cache group is of one kind (``group_kind``): full attention (MLA included), sliding
window, chunked local attention (Llama 4), or Mamba / linear-attention state in vLLM's
"align" cache mode; ``layout.py`` decides what a chunk keeps of each. Refused: cross
attention, local attention chunks that chunks neither divide nor are divided by, Mamba in
other modes or with speculative / prefill checkpoint blocks, context parallelism, pipeline
stages of unequal layer counts, and (``prefix_reuse_refused``: served, never cached) engines
whose own prefix caching vLLM turned off.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

FULL = "full"
SLIDING_WINDOW = "sliding_window"
LOCAL = "chunked_local"
MAMBA = "mamba"


class UnsupportedModel(ValueError):
    pass


def group_spec(spec: Any) -> Any:
    """A group's one KV cache spec, or UnsupportedModel saying why kvtier cannot store it."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = list(spec.kv_cache_specs.values())
        if len({(type(s), s.page_size_bytes) for s in inner}) != 1:
            raise UnsupportedModel(
                "kvtier needs one page size per KV cache group; this model's layers differ "
                "within a group (UniformTypeKVCacheSpecs)"
            )
        spec = inner[0]
    group_kind(spec)  # refuses what it cannot serve
    return spec


def group_kind(spec: Any) -> str:
    """FULL, SLIDING_WINDOW, LOCAL or MAMBA; UnsupportedModel, with the reason, for anything
    else."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if isinstance(spec, MambaSpec):
        return mamba_kind(spec)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return LOCAL
    if isinstance(spec, SlidingWindowSpec):
        if getattr(spec, "bounded_replay", False):
            raise UnsupportedModel(f"kvtier does not support {name} with bounded replay")
        return SLIDING_WINDOW
    if isinstance(spec, FullAttentionSpec):
        # With the hybrid allocator off, vLLM merges sliding-window and local-chunk layers
        # into a full group (its spec still names the window or the local chunk) that keeps
        # every block: stored whole, like full attention.
        return FULL
    raise UnsupportedModel(
        f"kvtier supports full and sliding-window attention, not {name} (this model's KV "
        "cache group cannot be stored as pages of consecutive tokens)"
    )


def mamba_kind(spec: Any) -> str:
    """A Mamba group kvtier can store: "align" mode, where block ``i`` holds the state after
    ``(i + 1) * block_size`` tokens, and nothing else in the block table."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedModel(
            f"kvtier stores Mamba / linear-attention state only with "
            f"mamba_cache_mode='align' (this engine: {mode!r}), where a block holds the state "
            "at its last token; enable prefix caching (vLLM then picks 'align')"
        )
    extra = (getattr(spec, "num_speculative_blocks", 0), spec.num_prefill_checkpoint_blocks)
    if any(extra):
        raise UnsupportedModel(
            "kvtier does not store Mamba state with speculative decoding or prefill "
            f"checkpoint blocks (num_speculative_blocks={extra[0]}, "
            f"num_prefill_checkpoint_blocks={extra[1]}): their states sit in blocks other "
            "than the one of their boundary"
        )
    return MAMBA


def advise_mamba_steps(step_tokens: int, chunk_tokens: int) -> None:
    """vLLM writes a Mamba layer's state into a block only at the end of a prefill step (and
    at the prompt's last block boundary). Every chunk is saved (one without state as its
    attention alone, ``save_no_state``), but a hit must end on a chunk with its state: where
    a step ended on a chunk boundary. Steps that are a multiple or a divisor of a chunk end on
    chunk boundaries every ``max(step, chunk)`` tokens of a prompt prefilled alone; other step
    sizes only every ``lcm(step, chunk)`` tokens."""
    if step_tokens % chunk_tokens and chunk_tokens % step_tokens:
        log.warning(
            "kvtier: a Mamba hybrid's hit ends where vLLM wrote the recurrent state, at the end "
            "of a prefill step, on a chunk boundary; max_num_batched_tokens=%d is neither a "
            "multiple nor a divisor of chunk_tokens=%d, so prefill steps meet chunk boundaries "
            "only every %d tokens and hits end there (the rest is recomputed, never a wrong "
            "token). A multiple of %d ends hits at every step.",
            step_tokens,
            chunk_tokens,
            math.lcm(step_tokens, chunk_tokens),
            chunk_tokens,
        )


def prefix_reuse_refused(vllm_config: VllmConfig) -> str | None:
    """Why this engine must serve no hits, or None. A hit is exact only where vLLM computes
    exactly over a cached prefix; where vLLM turns its own prefix caching off for a model it
    does not (MLA on CPU: vLLM disables it there, and with it forced on vLLM's own hits
    differ from a recompute too). kvtier then neither loads nor saves for this engine."""
    model = vllm_config.model_config
    if model is not None and model.use_mla and _on_cpu():
        # On a host with AMX vLLM keeps prefix caching on for MLA (its AMX MLA backend);
        # elsewhere it turns it off. Neither backend's computation over a cached prefix has
        # been shown exact against a recompute here: refused on every CPU host alike.
        return (
            f"MLA on vLLM's CPU build ({model.model}): a computation over a cached prefix is "
            "not known to be exact on its CPU MLA backends, so kvtier serves no hits and "
            "saves nothing for this engine"
        )
    if vllm_config.cache_config.enable_prefix_caching:
        return None
    why = " (vLLM turns it off for MLA on this platform)" if model.use_mla else ""
    return (
        f"vLLM's own prefix caching is off for {model.model}{why}: a computation over a "
        "cached prefix is not known to be exact here, so kvtier serves no hits and saves "
        "nothing for this engine"
    )


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_parallelism(parallel: Any, num_layers: int | None = None) -> None:
    """Refuse layouts whose blocks do not hold ``block_size`` consecutive tokens of one rank's
    heads: context parallelism (DCP/PCP) spreads a block's tokens over ranks, so a chunk key
    would name KV that no single rank holds. Pipeline stages must hold equally many layers
    (``num_layers`` over ``pipeline_parallel_size``): the scheduler sizes every stage's
    chunks from the first stage's KV cache, as vLLM's scheduler does."""
    pp = parallel.pipeline_parallel_size
    if pp > 1 and num_layers is not None:
        from vllm.distributed.utils import get_pp_indices

        split = [
            end - start for start, end in (get_pp_indices(num_layers, r, pp) for r in range(pp))
        ]
        if len(set(split)) > 1:
            raise UnsupportedModel(
                f"kvtier needs pipeline stages of equal layer counts, this model's "
                f"{num_layers} layers split {split} over {pp} stages: choose a "
                "pipeline_parallel_size that divides the layer count"
            )
    dcp = getattr(parallel, "decode_context_parallel_size", 1) or 1
    pcp = getattr(parallel, "prefill_context_parallel_size", 1) or 1
    if dcp > 1 or pcp > 1:
        raise UnsupportedModel(
            f"kvtier does not support context parallelism (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): with it a KV block holds tokens interleaved "
            "across ranks, which kvtier's chunks cannot name. Run without "
            "--decode-context-parallel-size/--prefill-context-parallel-size, or without kvtier."
        )
