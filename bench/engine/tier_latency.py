"""Time to first token by where a reused prefix is found: miss, GPU, DRAM (kvtier), peers.

    kvtier bench tier-latency [--lengths 2048,4096,8192] [--reps 5] [--configs kvtier,kvtier-disk]

For each prefix length L and repetition, a fresh random prompt of L tokens is sent to a fresh
vLLM instance (CPU build, random model of the ``cpu-bench`` preset unless ``--model``):
1. miss: first sight, recomputed (kvtier saves it to DRAM on the way);
2. gpu: sent again, vLLM's own prefix cache hits;
3. dram: after ``reset_prefix_cache`` (vLLM's cache only), kvtier loads it from DRAM.
Every request's tier is checked from vLLM's own counters (prompt tokens cached by source:
device / host / p2p); a request that landed in another tier than intended is reported and
left out of the figures, never averaged in. The same prompts go through a vLLM without any
connector (the miss baseline: what kvtier's saving costs) and through each peer (LMCache) in
their own processes. Floor: a memcpy of the same KV bytes, measured in this run.
``kvtier-disk`` (``tier_disk.py``) adds 4. disk: a prompt evicted from a small DRAM pool, staged
from the node store's disk tier, beside the filesystem's own write and read of the same bytes;
``lmcache-disk`` the same phases through LMCache with an L1 of the same size and its native
filesystem L2.
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.store.client.shm import page_aligned_empty
from kvtier.testing.models import make_model, vllm_env
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

WARMUP_TOKENS = 512


@dataclass
class Sample:
    config: str  # kvtier | baseline | lmcache ...
    tier: str  # intended: miss | gpu | dram
    length: int
    seconds: float
    cached_by_source: dict[str, float]
    verified: bool


@dataclass
class Report:
    model: str
    lengths: list[int]
    reps: int
    kv_bytes_per_token: int
    suffix: int = 0  # new tokens after the reused prefix in each request
    samples: list[Sample] = field(default_factory=list)
    floors: dict[int, float] = field(default_factory=dict)  # L -> memcpy seconds
    # a peer that does not run this model: its error, as the report says it
    failures: dict[str, str] = field(default_factory=dict)
    moved_bytes_per_token: int = 0  # what a DRAM hit loaded per token (the engine's counters)
    # kvtier-disk: L -> (seconds to write, to read) one file of that prompt's KV bytes
    disk_floors: dict[int, tuple[float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the tables

    def p(self, config: str, tier: str, length: int, q: float) -> float | None:
        xs = sorted(
            s.seconds
            for s in self.samples
            if s.config == config and s.tier == tier and s.length == length and s.verified
        )
        if not xs:
            return None
        return float(np.percentile(xs, q))

    def rejected(self) -> list[Sample]:
        return [s for s in self.samples if not s.verified]


def _verify(tier: str, length: int, cached: dict[str, float]) -> bool:
    """Did the request land in the tier we meant? (from vLLM's per-source counters)"""
    device, host, p2p = (cached.get(k, 0.0) for k in ("device", "host", "p2p"))
    disk = cached.get("disk", 0.0)
    mostly = 0.9 * length
    if tier == "miss":
        return device == host == p2p == disk == 0
    if tier == "disk":
        return disk >= mostly and device < 0.1 * length and host < 0.1 * length
    if tier == "gpu":  # all from vLLM's own cache (a peer topping it up is another tier)
        return device >= mostly and host == p2p == cached.get("external_unspecified", 0.0) == 0
    if tier == "dram":  # LMCache labels its hits external_unspecified, kvtier as host
        dram = host + cached.get("external_unspecified", 0.0)
        return dram >= mostly and device < 0.1 * length and p2p == 0
    if tier == "remote":
        return p2p >= mostly and device < 0.1 * length
    if tier == "l2":  # a peer's tier below DRAM; LMCache labels every hit external_unspecified
        return cached.get("external_unspecified", 0.0) >= mostly and device < 0.1 * length
    raise ValueError(tier)


def _prompts(lengths: list[int], reps: int, vocab: int, seed: int) -> dict[tuple[int, int], list]:
    rng = random.Random(seed)
    return {
        (L, r): [rng.randrange(4, vocab) for _ in range(L)] for r in range(reps) for L in lengths
    }


def _suffixes(length: int, vocab: int, seed: int) -> dict[str, list[int]]:
    """New tokens after the reused prefix, one run per tier (all empty when length is 0): the
    cached part of every request is then exactly the prefix, as in an agent's next turn."""
    rng = random.Random(seed + 7)
    return {
        tier: [rng.randrange(4, vocab) for _ in range(length)]
        for tier in ("miss", "gpu", "dram", "remote", "disk")
    }


def _phases_for(
    tiers: list[str], prompts: dict, warmup: list[int], suffixes: dict[str, list[int]]
) -> tuple[list, list]:
    """The driver script, and for each generate phase the (tier, length) it measures."""
    phases: list[dict] = [
        {"op": "generate", "prompts": [warmup], "max_tokens": 1},
        {"op": "generate", "prompts": [warmup], "max_tokens": 1},
    ]
    labels: list[tuple[str, int] | None] = [None, None]
    for (length, _), prompt in prompts.items():
        for tier in tiers:
            if tier == "dram":
                phases.append({"op": "reset_prefix_cache"})
                labels.append(None)
            request = prompt + suffixes[tier]
            phases.append({"op": "generate", "prompts": [request], "max_tokens": 1})
            labels.append((tier, length))
        phases.append({"op": "reset_prefix_cache"})
        labels.append(None)
    return phases, labels


def _collect(report: Report, config: str, results: list, labels: list) -> None:
    for result, label in zip(results, labels, strict=True):
        if label is None:
            continue
        tier, length = label
        (out,) = result
        report.samples.append(
            Sample(
                config,
                tier,
                length,
                out["seconds"],
                out["cached_by_source"],
                _verify(tier, length, out["cached_by_source"]),
            )
        )


def memcpy_floor(nbytes: int, repeat: int = 5) -> float:
    """Seconds to memcpy ``nbytes`` between page-aligned buffers (best of ``repeat``)."""
    src, dst = page_aligned_empty(nbytes), page_aligned_empty(nbytes)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


# A config: name -> function(model, run_dir) returning (driver spec additions, env additions,
# cleanup). Peers register here (bench/peers.py).
ConfigSetup = Callable[[str, Path], tuple[dict, dict, Callable[[], None]]]


def _kvtier(model: str, run_dir: Path, **settings: Any) -> tuple[dict, dict, Callable[[], None]]:
    extra = {"store": {"pool": {"capacity": "4GiB"}}, "min_hit_tokens": {"cpu": 256}, **settings}
    return (
        {"kv_transfer_config": kvtier_transfer_config(extra)},
        {"KVTIER_STORE__RUN_DIR": str(run_dir)},
        lambda: None,
    )


def _baseline(model: str, run_dir: Path) -> tuple[dict, dict, Callable[[], None]]:
    return {"kv_transfer_config": None}, {}, lambda: None


def _lmcache(model: str, run_dir: Path) -> tuple[dict, dict, Callable[[], None]]:
    from kvtier.bench.peers.lmcache import PRELOAD, LMCacheServer

    server = LMCacheServer(run_dir / "lmcache-server.log")
    server.start()
    return (
        {"kv_transfer_config": server.kv_transfer_config(), "preload": [PRELOAD]},
        {},
        server.stop,
    )


def _vllm_offload(connector: str) -> ConfigSetup:
    """vLLM's native CPU offloading (``SimpleCPUOffloadConnector`` / ``OffloadingConnector``):
    they need CUDA or XPU streams, so on the CPU build the report quotes their error."""

    def setup(model: str, run_dir: Path) -> tuple[dict, dict, Callable[[], None]]:
        config = {
            "kv_connector": connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30, "num_cpu_blocks": 4096},
        }
        return {"kv_transfer_config": config}, {}, lambda: None

    return setup


def _run_remote(
    report: Report,
    prompts: dict,
    warmup: list[int],
    suffixes: dict[str, list[int]],
    spec_base: dict,
    tmp: Path,
    progress: Callable[[str], None],
) -> None:
    """Two "nodes" (a store each, remote tier on) and an index. A vLLM on node B computes
    every prompt (stored in B's pool); then a vLLM on node A sends each one: a remote hit
    (pulled from B into A's pool over the transfer engine), then, after A's vLLM prefix cache
    is reset, a DRAM hit on A."""
    from kvtier.testing.services import start_index, start_store, wait_indexed

    run_dir = tmp / "remote"
    capacity = "4GiB"
    b = start_store(run_dir, capacity, "node-b")
    a = start_store(run_dir, capacity, "node-a", extra=("--peers", b.address))  # pulls from B
    index = start_index([a, b])
    try:

        def spec(store: Any, phases: list[dict]) -> dict:
            extra = {
                "store_address": store.address,
                "index_address": index.address,
                "tiers": ["cpu", "remote"],
                "remote_fetch_timeout_s": 30.0,
                "lookup_deadline_s": 60.0,  # a pull is given its whole timeout
                "min_hit_tokens": {"cpu": 256, "remote": 256},
            }
            return {
                **spec_base,
                "phases": phases,
                "kv_transfer_config": kvtier_transfer_config(extra),
            }

        env = vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir))
        progress("kvtier-remote: node B computes the prompts")
        seed = [
            {"op": "generate", "prompts": [p + suffixes["miss"]], "max_tokens": 1}
            for p in prompts.values()
        ]
        run_vllm(spec(b, seed), env, timeout=7200)
        chunks = sum(len(p) // 256 for p in prompts.values())
        wait_indexed(index, "node-b", chunks)
        progress("kvtier-remote: node A pulls them (remote hit), then hits its own DRAM")
        warm = {"op": "generate", "prompts": [warmup], "max_tokens": 1}
        phases, labels = _phases_for(["remote", "dram"], prompts, warmup, suffixes)
        phases[:2] = [warm, warm]
        results = run_vllm(spec(a, phases), env, timeout=7200)
        _collect(report, "kvtier-remote", results, labels)
    finally:
        index.stop()
        a.stop()
        b.stop()


CONFIGS: dict[str, tuple[ConfigSetup, list[str]]] = {
    "kvtier": (_kvtier, ["miss", "gpu", "dram"]),
    # the cost of checksumming every load (verify_loads), measured against not doing it
    "kvtier-verify": (functools.partial(_kvtier, verify_loads=True), ["miss", "gpu", "dram"]),
    "kvtier-noverify": (functools.partial(_kvtier, verify_loads=False), ["miss", "gpu", "dram"]),
    "baseline": (_baseline, ["miss", "gpu"]),
    "lmcache": (_lmcache, ["miss", "gpu", "dram"]),
    "vllm-simple-offload": (_vllm_offload("SimpleCPUOffloadConnector"), ["miss", "gpu", "dram"]),
    "vllm-offload": (_vllm_offload("OffloadingConnector"), ["miss", "gpu", "dram"]),
}


def run(
    lengths: list[int],
    reps: int,
    configs: list[str],
    model: str | None = None,
    preset: str = "cpu-bench",
    seed: int = 0,
    suffix: int = 32,
    progress: Callable[[str], None] = print,
) -> Report:
    """``suffix``: new tokens after the reused prefix (0: the prompt is resent unchanged, so a
    hit covers all of it but the last block; >0: an agent's next turn)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-tier-latency-") as tmp:
        tmp_path = Path(tmp)
        model_dir = model or str(
            make_model(Path(tempfile.gettempdir()) / f"kvtier-{preset}", preset)
        )
        params = json.loads((Path(model_dir) / "config.json").read_text())
        kv_per_token = (
            params["num_hidden_layers"]
            * 2
            * params["num_key_value_heads"]
            * params.get("head_dim", params["hidden_size"] // params["num_attention_heads"])
            * 4
        )  # as if fp32: sizes vLLM's KV cache (an upper bound); floors use the bytes moved
        report = Report(model_dir, lengths, reps, kv_per_token, suffix)
        vocab = params["vocab_size"]
        prompts = _prompts(lengths, reps, vocab, seed)
        suffix_tokens = _suffixes(suffix, vocab, seed)
        warmup = [random.Random(seed + 1).randrange(4, vocab) for _ in range(WARMUP_TOKENS)]
        max_len = max(lengths) + suffix + 64
        # what every vLLM instance of the run gets: the same model, context and KV cache
        spec_base = {
            "model": model_dir,
            "max_model_len": max_len,
            "kv_cache_bytes": 3 * max_len * kv_per_token + (64 << 20),
            "max_num_batched_tokens": 4096,
        }
        for name in configs:
            if name == "kvtier-remote":
                _run_remote(report, prompts, warmup, suffix_tokens, spec_base, tmp_path, progress)
                continue
            if name in ("kvtier-disk", "lmcache-disk"):
                pool = max_len * kv_per_token  # fp32-sized: about two bf16 prompts
                from kvtier.bench.engine import tier_disk

                disk_run = (
                    tier_disk.run_disk if name == "kvtier-disk" else tier_disk.run_lmcache_disk
                )
                disk_run(
                    report, prompts, warmup, suffix_tokens, spec_base, tmp_path, pool, progress
                )
                continue
            setup, tiers = CONFIGS[name]
            progress(f"{name}: {len(prompts)} prompts x {tiers} in a fresh vLLM instance")
            spec_extra, env_extra, cleanup = setup(model_dir, tmp_path / name)
            try:
                phases, labels = _phases_for(tiers, prompts, warmup, suffix_tokens)
                if name.startswith("kvtier"):  # what its DRAM hits moved, from its counters
                    phases, labels = [*phases, {"op": "metrics"}], [*labels, None]
                spec = {**spec_base, "phases": phases, **spec_extra}
                results = run_vllm(spec, vllm_env(**env_extra), timeout=7200)
            except RuntimeError as exc:
                if name.startswith("kvtier"):
                    raise  # our own failure is never a row of the report
                report.failures[name] = last_error(str(exc))
                progress(f"{name} does not run this model: {report.failures[name]}")
                continue
            finally:
                cleanup()
            _collect(report, name, results, labels)
            if name.startswith("kvtier") and not report.moved_bytes_per_token:
                report.moved_bytes_per_token = _moved_per_token(results[-1])
        # the floor copies the bytes a DRAM hit actually moved (vLLM's dtype="auto" runs a
        # float32 checkpoint in bf16 here; a sliding window's layers keep its tail only), as
        # the engine counted them; the configured estimate only where no hit was counted
        per_token = report.moved_bytes_per_token or kv_per_token
        for length in lengths:
            report.floors[length] = memcpy_floor(length * per_token)
    return report


def _moved_per_token(counters: dict[str, float]) -> int:
    """KV bytes per token a DRAM hit loaded, from the engine's counters (0: none counted)."""
    tokens = counters.get("vllm:kvtier_cpu_hit_tokens", 0) + counters.get(
        "vllm:kvtier_disk_hit_tokens", 0
    )
    loaded = counters.get("vllm:kvtier_loaded_bytes", 0)
    return round(loaded / tokens) if tokens else 0


def last_error(driver_output: str) -> str:
    """The exception a failed vLLM run ended with (its last ``...Error: ...`` line, with
    what wrapped onto the following lines), for a report to quote."""
    lines = [line.removeprefix("[rank0]: ").strip() for line in driver_output.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        head, _, _ = lines[i].partition(": ")
        if head.endswith(("Error", "Exception")):
            tail = [x for x in lines[i + 1 : i + 3] if x and ":" not in x[:30]]
            return " ".join([lines[i], *tail])
    return lines[-1] if lines else "failed"
