"""Pool bytes one prompt takes, by tensor-parallel size:

    kvtier bench pool-footprint --model-family deepseek-mla --tensor-parallel-sizes 1,2

Each size runs in a fresh vLLM engine against a fresh node store process: one prompt is
computed and saved, and the store's ``committed_bytes`` is read back once every rank's saves are
committed. An MLA model's latent KV is identical on every TP rank, so kvtier stores it once
(the ranks share one namespace, tp rank 0 saves): the TP-2 figure should equal the TP-1
figure. A model whose KV heads are split over ranks stores each rank's heads, so the figures
are equal there too (the same bytes, in twice the chunks).

An engine that kvtier serves no hits for saves nothing (``layout.prefix_reuse_refused``): on
vLLM's CPU build that is MLA, whose prefix caching vLLM turns off there even when asked for it.
Such a row reports the refusal, measured from the engine's own configuration, instead of
bytes: the MLA figure needs an engine whose prefix caching is on (CUDA).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from kvtier.testing.models import cpu_binding, make_family_model, vllm_env
from kvtier.testing.services import start_store, store_stats
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm


def measure(family: str, tp: int, prompt_tokens: int, tmp: Path) -> dict[str, Any]:
    """One prompt in a fresh engine of ``tp`` ranks: the store's bytes and chunks after it."""
    model = make_family_model(Path(tempfile.gettempdir()) / f"kvtier-footprint-{family}", family)
    row: dict[str, Any] = {"family": family, "tensor_parallel_size": tp}
    refused = _refused(model)
    if refused:
        return {**row, "prompt_tokens": prompt_tokens, "refused": refused}
    run_dir = tmp / f"tp{tp}"
    store = start_store(run_dir, "256MiB", f"footprint-tp{tp}", remote=False)
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(4, 500) for _ in range(prompt_tokens)]
        extra = {"chunk_tokens": 64, "min_hit_tokens": {"cpu": 64}, "store_address": store.address}
        spec = {
            "model": str(model),
            "phases": [{"op": "generate", "prompts": [prompt]}, {"op": "metrics"}],
            "kv_transfer_config": kvtier_transfer_config(extra),
            "engine_args": {"tensor_parallel_size": tp, "enable_prefix_caching": True},
        }
        _, counters = run_vllm(spec, vllm_env(**cpu_binding(ranks=tp)))  # a core per rank
        stats = store_stats(store.address, store.pid) or {}
        return {
            **row,
            "prompt_tokens": prompt_tokens,
            "used_bytes": int(stats.get("committed_bytes", 0)),
            "chunks": int(stats.get("chunks", 0)),
            "saved_bytes": int(counters.get("vllm:kvtier_saved_bytes", 0)),
        }
    finally:
        store.stop()


def _refused(model: Path) -> str | None:
    """Why kvtier would save nothing for this model here (vLLM's configuration of it, asked
    for prefix caching), or None."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from kvtier.connector.model_support import prefix_reuse_refused

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="auto"),
        cache_config=CacheConfig(enable_prefix_caching=True),
    )
    return prefix_reuse_refused(config)


def run(family: str, sizes: list[int], prompt_tokens: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="kvtier-footprint-") as tmp:
        return [measure(family, tp, prompt_tokens, Path(tmp)) for tp in sizes]


def print_report(rows: list[dict[str, Any]]) -> None:
    measured = [r for r in rows if "refused" not in r]
    base = measured[0]["used_bytes"] if measured else 0
    print("| model | TP | prompt tokens | pool bytes (pages) | KV bytes saved | chunks | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['family']} | {r['tensor_parallel_size']} | {r['prompt_tokens']} | "
                  f"not measurable: {r['refused']} | | | |")  # fmt: skip
            continue
        ratio = f"{r['used_bytes'] / base:.2f}x" if base else "-"
        print(
            f"| {r['family']} | {r['tensor_parallel_size']} | {r['prompt_tokens']} | "
            f"{r['used_bytes']:,} | {r['saved_bytes']:,} | {r['chunks']} | {ratio} |"
        )
