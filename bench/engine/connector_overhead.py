"""Scheduler-side connector cost per engine step against how much the node store holds.

    kvtier bench connector-overhead [--cached 0,1000,10000,100000]

A field report (docs/reference-numbers) measured a connector whose per-step cost grew with the
cache (+94.5 µs per 1k cached blocks per step, from an O(|cache|) sync each step). kvtier's
scheduler side touches only the requests scheduled in a step and their chunks, so its cost per
step should not move when the store holds 100x more.

For each N: a fresh node store process is filled with N chunks (other prompts, so the
workload's lookups walk a table of N entries), then a fresh vLLM (tiny model, connector
pointed at that store) runs a fixed workload twice (stores it, then hits it after
``reset_prefix_cache``). The seconds spent inside the scheduler-side connector hooks are
divided by the engine steps.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.testing.models import make_model, vllm_env
from kvtier.testing.services import start_store
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm
from kvtier.tiers import connect

FILLER_CHUNK = 4096


def _fill(address: str, n: int) -> None:
    ns = Namespace(
        model="filler",
        dtype="uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=FILLER_CHUNK,
        chunk_tokens=16,
    )
    data = np.zeros(FILLER_CHUNK, dtype=np.uint8)
    with connect(StoreConfig(address=address)) as tier:
        ns_id = tier.register_namespace(ns, FILLER_CHUNK)
        batch = 2000
        for start in range(0, n, batch):
            count = min(batch, n - start)
            tokens = np.arange(start * 16, (start + count) * 16, dtype=np.uint32)
            keys = prompt_keys(ns, tokens)
            tier.put(ns_id, keys, [data] * count)


def run(
    cached: list[int], prompts: int = 8, prompt_tokens: int = 1024, max_tokens: int = 32
) -> list[dict]:
    model = str(make_model(Path(tempfile.gettempdir()) / "kvtier-tiny", "tiny"))
    rng = random.Random(0)
    workload = [[rng.randrange(4, 500) for _ in range(prompt_tokens)] for _ in range(prompts)]
    rows = []
    for n in tqdm(cached, desc="cached chunks", unit="config"):
        with tempfile.TemporaryDirectory(prefix="kvtier-overhead-") as tmp:
            capacity = f"{(n * FILLER_CHUNK >> 20) + 512}MiB"
            store = start_store(Path(tmp), capacity, "bench-overhead", remote=False)
            try:
                _fill(store.address, n)
                extra = {
                    "store_address": store.address,
                    "chunk_tokens": 64,
                    "min_hit_tokens": {"cpu": 64},
                }
                phases = [
                    {"op": "connector_timing"},
                    {"op": "generate", "prompts": workload, "max_tokens": max_tokens},
                    {"op": "connector_timing"},
                    {"op": "reset_prefix_cache"},
                    {"op": "generate", "prompts": workload, "max_tokens": max_tokens},
                    {"op": "connector_timing"},
                ]
                spec = {
                    "model": model,
                    "phases": phases,
                    "max_model_len": prompt_tokens + 64,
                    "kv_transfer_config": kvtier_transfer_config(extra),
                }
                results = run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=tmp))
            finally:
                store.stop()
        store_pass, hit_pass = results[2], results[5]
        rows.append(
            {
                "cached_chunks": n,
                "store_pass_us_per_step": store_pass["seconds"] / store_pass["steps"] * 1e6,
                "hit_pass_us_per_step": hit_pass["seconds"] / hit_pass["steps"] * 1e6,
                "steps": store_pass["steps"] + hit_pass["steps"],
                "hits": sum(r["cached_by_source"].get("host", 0) for r in results[4]),
            }
        )
    return rows


def print_report(rows: list[dict]) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(title="scheduler-side connector time per engine step vs chunks in the store")
    for col in (
        "chunks in store",
        "µs/step (storing)",
        "µs/step (hitting)",
        "steps",
        "DRAM hit tokens",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            f"{row['cached_chunks']:,}",
            f"{row['store_pass_us_per_step']:.0f}",
            f"{row['hit_pass_us_per_step']:.0f}",
            str(row["steps"]),
            f"{row['hits']:,.0f}",
        )
    console().print(table)
