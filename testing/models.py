"""Random-weight models that vLLM runs, made locally (no hub downloads).

Llama (the default), and one tiny model per architecture family kvtier's support matrix
names (docs/connector.md): ``FAMILIES`` maps a family to its maker.

``tiny`` is what the tests use (seconds to prefill anything); ``cpu-bench`` is sized so that a
miss at 8k tokens costs seconds on a small CPU machine, which is what the tier-latency
benchmark needs to show the tiers apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _tokenizer(vocab_size: int, extra_specials: tuple[str, ...] = ()):
    """Word-level tokenizer over "t0".."tN" + specials: offline, tokenizers library only.
    ``extra_specials`` (a vision model's image tokens) take the ids after the four base ones
    and split out of text without spaces around them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", *extra_specials]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"t{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    if extra_specials:
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in extra_specials]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    # A chat template, so /v1/chat/completions works (and the router renders chats as vLLM
    # does): each message framed by <s> ... </s>, a bare <s> to prompt the answer.
    fast.chat_template = (
        "{% for m in messages %}{{ '<s> ' + m['content'] + ' </s> ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<s>' }}{% endif %}"
    )
    return fast


PRESETS: dict[str, dict] = {
    "tiny": {},
    # fp32 (this CPU has no fast bf16), 8 KiB of KV per token: a miss at 8k tokens takes
    # seconds on 2 cores while a cache hit takes a fraction of a second
    "cpu-bench": {
        "vocab_size": 4096,
        "hidden_size": 512,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 64,
        "max_positions": 16384,
    },
    # cpu-bench's size as a Gemma-3 hybrid: 2 sliding-window layers (1024 tokens) + 2 full
    "cpu-bench-swa": {
        "family": "gemma3-swa",
        "vocab_size": 4096,
        "hidden_size": 512,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 64,
        "max_positions": 16384,
        "sliding_window": 1024,
    },
}
# the same weights as cpu-bench (same seed and shapes), with room for 32k-token prompts:
# tier-latency's longest row (cpu-bench stays at 16k so the demo's small KV caches hold one
# whole request at vLLM's default context length)
PRESETS["cpu-bench-32k"] = {**PRESETS["cpu-bench"], "max_positions": 33280}


def make_model(out_dir: str | Path, preset: str = "tiny") -> Path:
    """A random model of a named preset (written once; reused if already there)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
    sizes = dict(PRESETS[preset])
    if sizes.pop("family", "llama") == "gemma3-swa":
        return make_tiny_gemma3(out_dir, **sizes)
    return make_tiny_llama(out_dir, **sizes)


def make_tiny_llama(
    out_dir: str | Path, *, seed: int = 0, dtype: str = "float32", **shape: Any
) -> Path:
    """Write the model and tokenizer to ``out_dir`` (once) and return it. ``shape``:
    ``llama_config``'s sizes.

    Weights are scaled x5 so logits are far from uniform and logprob comparisons mean
    something. ``head_dim`` must be one vLLM's CPU attention supports (32, 64, 80, 96, ...).
    """
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = llama_config(dtype=dtype, **shape)
    model = LlamaForCausalLM(config)
    return _save_scaled(model, out, config.vocab_size, getattr(torch, dtype))


def llama_config(
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_positions: int = 4096,
    dtype: str = "float32",
) -> Any:
    """The tiny Llama's config (a vision model's text model takes it too); specials as
    ``_tokenizer``'s."""
    from transformers import LlamaConfig

    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )


def scale_weights(model: Any) -> None:
    """Scale the random weights x5: logits far from uniform, so logprob comparisons mean
    something."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(5.0)


def _save_scaled(model: Any, out: Path, vocab_size: int, dtype: Any = None) -> Path:
    """Scale the random weights (``scale_weights``), cast them to ``dtype`` and write the
    model and its tokenizer to ``out``."""
    scale_weights(model)
    if dtype is not None:
        model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(vocab_size).save_pretrained(out)
    return out


def make_tiny_deepseek_v2(out_dir: str | Path, *, seed: int = 0) -> Path:
    """A random DeepSeek-V2 geometry (MLA: one 64 + 32-wide latent per token and layer, two
    layers, a dense first layer and a small MoE) that vLLM's CPU build runs. vLLM turns its
    own prefix caching off for MLA on CPU (its cached-prefix path is not exact there)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_scaled(DeepseekV2ForCausalLM(config), out, 512)


def make_tiny_gemma3(
    out_dir: str | Path,
    *,
    sliding_window: int = 64,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A random Gemma-3 text geometry: sliding-window layers (window ``sliding_window``
    tokens) alternating with full-attention ones, i.e. two KV cache groups under vLLM's
    hybrid memory allocator (gpt-oss and Cohere 2 have the same two kinds)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        query_pre_attn_scalar=head_dim,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
        dtype="float32",
    )
    return _save_scaled(Gemma3ForCausalLM(config), out, vocab_size, torch.float32)


def make_tiny_qwen3_next(out_dir: str | Path, *, seed: int = 0, linear_heads: int = 1) -> Path:
    """A random Qwen3-Next geometry (bf16): a gated-delta-net linear-attention layer (Mamba
    state, vLLM's ``MambaSpec``) beside a full-attention layer, with a small MoE. Linear heads
    are 128 wide: vLLM's CPU kernel refuses narrower ones ("Unexpected head dim size");
    ``linear_heads`` of them (2 for tensor parallelism 2: TP splits them)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        # 2 KiB of attention KV per token against ~66 KiB of recurrent state: vLLM sizes a
        # block so its attention page holds the state (here 64 tokens, not 544)
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        linear_num_value_heads=linear_heads,
        linear_num_key_heads=linear_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    return _save_scaled(Qwen3NextForCausalLM(config), out, 512, torch.bfloat16)


def make_tiny_llama4(
    out_dir: str | Path, *, seed: int = 0, attention_chunk_size: int = 128, moe: bool = True
) -> Path:
    """A Llama 4 text model: layers 0-2 attend within ``attention_chunk_size``-token spans
    (RoPE), layer 3 globally (NoPE), as Llama 4's "iRoPE"; layers 1 and 3 mixture-of-experts
    (2 experts, top 1, plus the shared one) unless ``moe`` is False. vLLM groups the local
    layers' KV apart from the global layer's (``ChunkedLocalAttentionSpec``)."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = Llama4TextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,  # an expert's width
        intermediate_size_mlp=256,  # a dense layer's
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        attention_chunk_size=attention_chunk_size,
        no_rope_layer_interval=4,  # layer i is global (NoPE) iff (i + 1) % 4 == 0
        # vLLM picks MoE layers by this step alone, transformers by moe_layers derived from
        # it: give only the step so both agree (a step past the last layer: all dense)
        interleave_moe_layer_step=2 if moe else 5,
        num_local_experts=2,
        num_experts_per_tok=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return _save_scaled(Llama4ForCausalLM(config), out, 512, torch.float32)


# architecture family -> (maker, what it stands for); docs/connector.md's support matrix
FAMILIES: dict[str, tuple[Any, str]] = {
    "llama": (make_tiny_llama, "dense full attention (Llama, Qwen, Mistral)"),
    "gemma3-swa": (make_tiny_gemma3, "sliding window + full attention (Gemma 3, gpt-oss)"),
    "deepseek-mla": (make_tiny_deepseek_v2, "multi-head latent attention (DeepSeek V2/V3)"),
    "qwen3-next": (make_tiny_qwen3_next, "linear attention + full attention (Qwen3-Next)"),
    "llama4-local": (make_tiny_llama4, "chunked local + global attention, MoE (Llama 4)"),
}


def make_family_model(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """The tiny random model of an architecture family (``FAMILIES``), written once;
    another ``seed``: the same architecture with other weights."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[family][0](out_dir, seed=seed)


@dataclass(frozen=True)
class ModelInfo:
    """What benchmarks need to size prompts and KV for a model directory (Llama-like config)."""

    vocab_size: int
    max_positions: int
    num_layers: int
    kv_bytes_per_token: int  # all layers, K and V, at ``dtype_bytes`` per element

    @classmethod
    def read(cls, model_dir: str | Path, dtype_bytes: int = 4) -> ModelInfo:
        params = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = params.get("head_dim") or params["hidden_size"] // params["num_attention_heads"]
        kv_heads = params.get("num_key_value_heads", params["num_attention_heads"])
        layers = params["num_hidden_layers"]
        return cls(
            vocab_size=params["vocab_size"],
            max_positions=params.get("max_position_embeddings", 2048),
            num_layers=layers,
            kv_bytes_per_token=layers * 2 * kv_heads * head_dim * dtype_bytes,
        )


VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: ~3 s to start instead of ~17 s
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **VLLM_ENV, **cpu_binding(), **extra}


def cpu_binding(slot: int = 0, slots: int = 1, ranks: int = 1) -> dict[str, str]:
    """The cores vLLM's CPU workers compute on, named explicitly, the same with or without a
    KV connector.

    Why: vLLM's automatic binding reserves one core for its scheduler process, and one more
    whenever ``--kv-transfer-config`` is given (meant for NIXL's transfers). On a 2-core
    machine that flips the worker from 1 OpenMP thread (no connector) to 2 (any connector,
    even one that does nothing), so a baseline without a connector prefilled ~1.6x slower than
    the same vLLM with one (measured with a no-op connector; docs/benchmarks.md). And with
    several engines on one machine the automatic binding puts every worker on the same core.

    One engine (``slots`` = 1) gets every core with no reservation (what vLLM does with a
    connector here, and the faster setting for the baseline too); engine ``slot`` of several
    gets a core of its own, round robin; ``ranks`` > 1 (TP / PP): one core per rank."""
    cores = sorted(os.sched_getaffinity(0))
    if slots == 1 and ranks == 1:
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
    first = slot * ranks
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(
            str(cores[(first + rank) % len(cores)]) for rank in range(ranks)
        )
    }
