"""The model shapes of docs/connector.md's support matrix, each a tiny random model in a real
vLLM CPU engine: hits give exactly a recompute's logprobs, or the model is refused at
start-up with the reason.

- sliding window + full attention (Gemma 3 geometry) under vLLM's hybrid memory allocator;
- tensor parallelism 2: tests/drills/test_model_family_drills.py (its drill's phases after
  the fault are exact TP-2 hits, compared with a TP-2 reference);
- pipeline parallelism 2 (compiled: vLLM's CPU build fails an assertion in eager mode);
- linear attention / Mamba state beside full attention (Qwen3-Next geometry, align mode): exact
  at TP 1 and TP 2, and across prefill step sizes (other cache modes: unit-tested refusals);
- fp8 KV caches: exact, and never shared with another KV dtype.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.testing.models import (
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_llama4,
    make_tiny_qwen3_next,
    vllm_env,
)
from kvtier.testing.services import start_store
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

pytestmark = pytest.mark.vllm


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()}


# vLLM's CPU attention runs fp8 KV caches only on x86 with AVX-512 or AMX ("FP8 KV cache on CPU
# requires x86 with AVX-512 or AMX"): a property of the machine, not of kvtier
FP8_KV_ON_THIS_CPU = bool(_cpu_flags() & {"avx512f", "amx_tile"})

HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (no NUMA node per rank)


def prompts(seed: int, lengths: list[int], shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(4, 500) for _ in range(n - shared_prefix)] for n in lengths]


def dram_round_trip(model: Path, batch: list[list[int]], run_dir: Path, extra: dict, **spec):
    """Recompute (and save), reset vLLM's own cache, the same prompts from DRAM, then from
    vLLM's own cache: (reference, DRAM, GPU outputs, counters after the DRAM pass)."""
    phases = [
        {"op": "generate", "prompts": batch, "prompt_logprobs": True},
        {"op": "reset_prefix_cache"},
        {"op": "generate", "prompts": batch},
        {"op": "metrics"},
        {"op": "generate", "prompts": batch},
    ]
    spec = {
        "model": str(model),
        "phases": phases,
        "kv_transfer_config": kvtier_transfer_config(extra),
        **spec,
    }
    env = vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir), **spec.pop("env", {}))
    reference, _, dram, metrics, gpu = run_vllm(spec, env)
    return reference, dram, gpu, metrics


def assert_exact(reference: list[dict], got: list[dict]) -> None:
    for ref, out in zip(reference, got, strict=True):
        assert out["tokens"] == ref["tokens"]
        assert out["logprobs"] == ref["logprobs"]  # bit-exact


def test_sliding_window_hybrid_hits_are_exact(tmp_path: Path, run_dir: Path) -> None:
    """Gemma 3 geometry (a 64-token window beside full attention) with 256-token chunks: a
    chunk keeps all 8 full-attention blocks and the window's last 2, hits end on chunk
    boundaries, and every DRAM and GPU hit is exact."""
    model = make_tiny_gemma3(tmp_path / "gemma3", sliding_window=64)
    # 300: one chunk + a partial one; 520: two chunks (a hit never takes the last block,
    # and the window's blocks are kept per chunk end); 40: none; two sharing 270 tokens
    batch = prompts(1, [300, 520, 40]) + prompts(2, [280, 540], shared_prefix=270)
    extra = {"chunk_tokens": 256, "min_hit_tokens": {"cpu": 256}}
    reference, dram, gpu, metrics = dram_round_trip(model, batch, run_dir, extra)
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == [256, 512, 0, 256, 512]
    # both layers' pages: 8 full-attention blocks + 2 window blocks of 8 KiB (bf16)
    page = 32 * 2 * 32 * 2 * 2  # tokens, K+V, head_dim, kv heads, bytes
    saved = metrics["vllm:kvtier_saved_bytes"] / metrics["vllm:kvtier_saved_chunks"]
    assert saved == (8 + 2) * page
    assert metrics["vllm:kvtier_load_error_blocks"] == 0


def test_pipeline_parallel_2_hits_are_exact(tmp_path: Path, run_dir: Path) -> None:
    """PP 2 (vLLM's CPU build runs it compiled, not eager): each stage saves and loads its
    own layer's chunks, and a hit needs every stage's."""
    model = make_tiny_llama(tmp_path / "llama")
    batch = prompts(4, [300, 520])
    extra = {"chunk_tokens": 64, "min_hit_tokens": {"cpu": 64}}
    reference, dram, gpu, metrics = dram_round_trip(
        model,
        batch,
        run_dir,
        extra,
        engine_args={"pipeline_parallel_size": 2, "enforce_eager": False},
        env=TP2_ENV,
    )
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == [256, 512]
    assert metrics["vllm:kvtier_committed_chunks"] == 2 * (4 + 8)  # one per stage each
    assert metrics[HOST] == 256 + 512


def test_mamba_hybrid_hits_are_exact(tmp_path: Path, run_dir: Path) -> None:
    """Qwen3-Next geometry (a gated-delta-net layer's recurrent state beside full attention,
    vLLM's ``mamba_cache_mode="align"``): a chunk keeps its attention blocks and the state
    after its last token, a load fills the state block at the hit boundary, and every DRAM
    and GPU hit is exact. Steps of one chunk (``max_num_batched_tokens``) make vLLM write the
    state at every chunk boundary, so every chunk of a prompt is saved."""
    model = make_tiny_qwen3_next(tmp_path / "qwen3-next")
    # vLLM sizes this model's blocks to 64 tokens (the attention page holds the state); 300
    # and 500: one chunk + a partial one (a hit never takes the last block); 600: two; 140:
    # none
    batch = prompts(5, [300, 500, 600, 140])
    extra = {"chunk_tokens": 256, "min_hit_tokens": {"cpu": 256}}
    reference, dram, gpu, metrics = dram_round_trip(
        model, batch, run_dir, extra, engine_args={"max_num_batched_tokens": 256}
    )
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == [256, 256, 512, 0]
    assert metrics[HOST] == 256 + 256 + 512
    # a chunk: 256 tokens of attention KV (2 KiB a token: bf16, 4 KV heads of 128) and one
    # state page, a block's worth of bytes; a load of n chunks moves n chunks' attention and one
    # state page. vLLM sizes the blocks so a page holds the state, which depends on the CPU
    # (64 tokens with AVX-512 or AMX, 32 on an AVX2-only host): read the block back from what a
    # chunk took, then hold the load to it
    token_bytes = 2 * 4 * 128 * 2
    saved = metrics["vllm:kvtier_saved_bytes"] / metrics["vllm:kvtier_saved_chunks"]
    block = int(saved) // token_bytes - 256
    assert block in (32, 64), str({k: v for k, v in metrics.items() if "kvtier" in k and v})
    assert saved == (256 + block) * token_bytes
    assert metrics["vllm:kvtier_loaded_bytes"] == (4 * 256 + 3 * block) * token_bytes
    assert metrics["vllm:kvtier_load_error_blocks"] == 0


def test_mamba_hybrid_hits_reach_the_last_prefill_step_that_ended_on_a_chunk(
    tmp_path: Path, run_dir: Path
) -> None:
    """Prefill steps of two chunks (vLLM writes the state only where a step ends): every
    chunk is saved, the ones no step ended on as their attention alone, and the next prompt
    hits through them up to the last whole chunk. A 1,100-token prompt prefilled in
    512-token steps has its state at 512 and 1,024: a hit of 1,024 tokens, exact, where
    saving only chunks with a state gave none (a hit needs every chunk before it)."""
    model = make_tiny_qwen3_next(tmp_path / "qwen3-next")
    batch = prompts(8, [1100])
    extra = {"chunk_tokens": 256, "min_hit_tokens": {"cpu": 256}}
    reference, dram, gpu, metrics = dram_round_trip(
        model, batch, run_dir, extra, engine_args={"max_num_batched_tokens": 512}
    )
    counters = str({k: v for k, v in metrics.items() if "kvtier" in k and v})
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == [1024], counters
    assert metrics["vllm:kvtier_save_no_state"] == 2, counters  # chunks 1 and 3
    assert metrics["vllm:kvtier_load_error_blocks"] == 0, counters
    # four chunks' attention and one state page loaded (the hit's end); saved: four
    # chunks' attention and the two states (block: 32 or 64 tokens, by the CPU)
    token_bytes = 2 * 4 * 128 * 2
    block = int(metrics["vllm:kvtier_loaded_bytes"]) // token_bytes - 1024
    assert block in (32, 64), counters
    assert metrics["vllm:kvtier_saved_bytes"] == (1024 + 2 * block) * token_bytes, counters


def test_mamba_hybrid_tp2_hits_are_exact(tmp_path: Path, run_dir: Path) -> None:
    """TP 2 splits the linear-attention heads (one per rank) and the KV heads: each rank saves
    and loads its own state and KV, every hit exact. Steps of one chunk make every chunk
    boundary a state: 576 tokens, whole blocks of this model at TP 2 on every CPU seen (72
    tokens with AVX-512 or AMX, 64 on an AVX2-only host: vLLM sizes a page to hold the
    state)."""
    model = make_tiny_qwen3_next(tmp_path / "qwen3-next-2", linear_heads=2)
    batch = prompts(7, [600, 1200])
    extra = {"chunk_tokens": 576, "min_hit_tokens": {"cpu": 576}}
    reference, dram, gpu, metrics = dram_round_trip(
        model,
        batch,
        run_dir,
        extra,
        engine_args={"max_num_batched_tokens": 576, "tensor_parallel_size": 2},
        env=TP2_ENV,
    )
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    counters = str({k: v for k, v in metrics.items() if "kvtier" in k and v})
    assert [r["num_cached_tokens"] for r in dram] == [576, 1152], counters
    assert metrics["vllm:kvtier_committed_chunks"] == 2 * 3, counters  # one per rank each
    assert metrics["vllm:kvtier_load_error_blocks"] == 0


def test_mamba_hybrid_tp2_hits_run_through_chunks_stored_without_state(
    tmp_path: Path, run_dir: Path
) -> None:
    """TP 2 with prefill steps of two chunks: each rank stores the first chunk as its
    attention alone, in its own sibling namespace, and the hit runs through it on both ranks
    to a chunk with its state. 1,800 tokens in 1,152-token steps: states at 1,152 and at the
    prompt's last block boundary (1,728 with 72-token blocks, a chunk boundary; 1,792 with the
    64-token blocks of an AVX2-only host, which is not)."""
    model = make_tiny_qwen3_next(tmp_path / "qwen3-next-2", linear_heads=2)
    batch = prompts(9, [1800])
    extra = {"chunk_tokens": 576, "min_hit_tokens": {"cpu": 576}}
    reference, dram, gpu, metrics = dram_round_trip(
        model,
        batch,
        run_dir,
        extra,
        engine_args={"max_num_batched_tokens": 1152, "tensor_parallel_size": 2},
        env=TP2_ENV,
    )
    counters = str({k: v for k, v in metrics.items() if "kvtier" in k and v})
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert dram[0]["num_cached_tokens"] in (1152, 1728), counters
    assert metrics["vllm:kvtier_save_no_state"] >= 1, counters  # the first chunk
    assert metrics["vllm:kvtier_load_error_blocks"] == 0, counters


def test_mamba_chunks_saved_in_short_steps_load_exactly_into_long_ones(
    tmp_path: Path, run_dir: Path
) -> None:
    """The step size decides which chunks an engine saves, not what a load computes: chunks
    saved by an engine with 256-token prefill steps, loaded into one with 8,192-token steps,
    give exactly that engine's own recompute."""
    model = make_tiny_qwen3_next(tmp_path / "qwen3-next")
    batch = prompts(6, [600, 900])
    store = start_store(run_dir, "256MiB", "mamba-node", remote=False)
    try:
        extra = {"store_address": store.address, "chunk_tokens": 256}
        env = vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir))

        def engine(phases: list[dict], steps: int, connector: bool = True) -> list:
            spec = {
                "model": str(model),
                "phases": phases,
                "kv_transfer_config": kvtier_transfer_config(extra) if connector else None,
                "engine_args": {"max_num_batched_tokens": steps},
            }
            return run_vllm(spec, env)

        engine([{"op": "generate", "prompts": batch}, {"op": "settle"}], 256)
        (reference,) = engine(
            [{"op": "generate", "prompts": batch, "prompt_logprobs": True}], 8192, False
        )
        (hits,) = engine([{"op": "generate", "prompts": batch}], 8192)
    finally:
        store.stop()
    assert [r["num_cached_tokens"] for r in hits] == [512, 768]
    assert_exact(reference, hits)


@pytest.mark.skipif(
    not FP8_KV_ON_THIS_CPU, reason="vLLM's CPU build runs fp8 KV only with AVX-512 or AMX"
)
def test_fp8_kv_cache_hits_are_exact_and_never_shared_with_another_dtype(
    tmp_path: Path, run_dir: Path
) -> None:
    """vLLM's CPU build runs fp8 KV caches (``kv_cache_dtype`` fp8 / fp8_e5m2; 1 byte per
    element). The KV dtype is in the namespace (``dtype`` and ``kv_layout``'s ``kvdtype``):
    fp8 hits are exact, and an instance with another KV dtype on the same node store finds
    none of them (same prompts, same model)."""
    model = make_tiny_llama(tmp_path / "llama")
    store = start_store(run_dir, "256MiB", "fp8-node", remote=False)
    try:
        batch = prompts(5, [300, 520])
        extra = {"chunk_tokens": 64, "min_hit_tokens": {"cpu": 64}, "store_address": store.address}
        reference, dram, gpu, metrics = dram_round_trip(
            model, batch, run_dir, extra, engine_args={"kv_cache_dtype": "fp8"}
        )
        assert_exact(reference, dram)
        assert_exact(reference, gpu)
        assert metrics[HOST] == 256 + 512
        page = 32 * 2 * 32 * 2 * 1  # tokens, K+V, head_dim, kv heads, 1 byte
        saved = metrics["vllm:kvtier_saved_bytes"] / metrics["vllm:kvtier_saved_chunks"]
        assert saved == 2 * 2 * page  # 2 layers x 2 blocks
        # the other fp8 format: pages of the same size, other bytes (bf16's differ in size too)
        for other in ("fp8_e5m2",):
            spec = {
                "model": str(model),
                "phases": [{"op": "generate", "prompts": batch}, {"op": "metrics"}],
                "kv_transfer_config": kvtier_transfer_config(extra),
                "engine_args": {"kv_cache_dtype": other},
            }
            _, counters = run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)))
            assert counters.get(HOST, 0) == 0, other
            assert counters["vllm:kvtier_committed_chunks"] == 4 + 8, other  # its own
    finally:
        store.stop()


@pytest.mark.parametrize(
    ("span", "chunk", "hits"),
    [
        # chunks of 64 inside 128-token local spans: every chunk keeps its local blocks (the
        # hits at 192 and 448 end inside a span and need the chunk before them)
        (128, 64, [256, 512, 0, 192, 448, 256, 512]),
        # 128-token chunks over 64-token spans: a boundary starts a span, no local block kept
        (64, 128, [256, 512, 0, 128, 384, 256, 512]),
    ],
)
def test_chunked_local_attention_hits_are_exact(
    tmp_path: Path, run_dir: Path, span: int, chunk: int, hits: list[int]
) -> None:
    """Llama 4 geometry (3 layers attending within local spans, 1 global, MoE) under vLLM's
    hybrid allocator: every DRAM and GPU hit gives a recompute's logprobs, and the local
    groups' pages are saved only where a hit at a chunk boundary needs them."""
    model = make_tiny_llama4(tmp_path / f"llama4-{span}", attention_chunk_size=span)
    batch = prompts(5, [300, 520, 40, 200, 450]) + prompts(6, [280, 540], shared_prefix=270)
    extra = {"chunk_tokens": chunk, "min_hit_tokens": {"cpu": chunk}}
    reference, dram, gpu, metrics = dram_round_trip(model, batch, run_dir, extra)
    assert_exact(reference, dram)
    assert_exact(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == hits
    page = 32 * 2 * 32 * 2 * 2  # tokens, K+V, head_dim, kv heads, bytes (bf16)
    kept = chunk // 32 if chunk < span else 0  # per local layer
    saved = metrics["vllm:kvtier_saved_bytes"] / metrics["vllm:kvtier_saved_chunks"]
    assert saved == (3 * kept + chunk // 32) * page
    assert metrics["vllm:kvtier_load_error_blocks"] == 0
