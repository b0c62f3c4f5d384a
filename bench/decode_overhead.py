"""What kvtier's connector costs a decode step: one vLLM server, the same streamed workload,
with and without the connector.

    kvtier bench decode-overhead [--repeats 2] [--requests 48] [--concurrency 8]

Configurations, each a freshly started OpenAI server (the ``cpu-bench`` model, 32 MiB of KV),
interleaved repeat by repeat so a machine's drift hits all of them alike:

- ``vllm``: no KV connector (the floor);
- ``kvtier-embedded``: kvtier's connector with an embedded store in the engine process;
- ``kvtier-store``: kvtier's connector with a node store process (gRPC over loopback).

The workload: ``requests`` distinct random prompts (every one a miss, so every prompt's
chunks are saved while other requests decode), ``concurrency`` streams at a time,
``max_tokens`` generated each (``ignore_eos``). TPOT = (last token - first token) / (tokens
- 1) per request, on the client's clock; TTFT beside it. A warm-up batch runs first.

The question it answers: does the connector's per-step work (save planning, copies into the
pool) slow decoding? It isolates the connector from a cluster's other processes (router,
index, several engines on the same cores), which ``kvtier bench cluster`` cannot.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvtier.bench.models import make_model
from kvtier.bench.services import start_store
from kvtier.bench.vllm_driver import kvtier_transfer_config
from kvtier.bench.vllm_server import VllmServer

CONFIGS = ("vllm", "kvtier-embedded", "kvtier-store")


@dataclass
class Settings:
    repeats: int = 2
    requests: int = 48
    concurrency: int = 8
    prompt_tokens: int = 300
    max_tokens: int = 32
    preset: str = "cpu-bench"
    kv_cache_bytes: int = 32 << 20
    pool: str = "256MiB"


@dataclass
class Samples:
    tpot_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    per_repeat_tpot_p50: list[float] = field(default_factory=list)


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"{len(arrivals)} tokens streamed; expected {max_tokens}")
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1), arrivals[0] - sent


async def _drive(url: str, prompts: list[list[int]], s: Settings) -> list[tuple[float, float]]:
    import aiohttp

    gate = asyncio.Semaphore(s.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def go(prompt: list[int]) -> tuple[float, float]:
            async with gate:
                return await _one(session, url, prompt, s.max_tokens)

        return await asyncio.gather(*(go(p) for p in prompts))


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(tokens)] for _ in range(n)]


def _serve_once(config: str, model: Path, workdir: Path, s: Settings, seed: int) -> list:
    """Start ``config``'s server, warm it up, run the workload, stop everything."""
    store = None
    extra_args: list[str] = []
    env: dict[str, str] = {"KVTIER_STORE__RUN_DIR": str(workdir)}
    if config != "vllm":
        extra = {"chunk_tokens": 64, "store": {"pool": {"capacity": s.pool}}}
        if config == "kvtier-store":
            store = start_store(workdir, s.pool, "decode-bench", remote=False)
            extra = {"chunk_tokens": 64, "store_address": store.address}
        extra_args = ["--kv-transfer-config", json.dumps(kvtier_transfer_config(extra))]
    server = VllmServer(
        model, workdir / f"{config}.log", kv_cache_bytes=s.kv_cache_bytes, extra_args=extra_args,
        env=env,
    )  # fmt: skip
    try:
        server.wait_ready()
        asyncio.run(_drive(server.url, _prompts(s.concurrency, s.prompt_tokens, 10**6 + seed), s))
        return asyncio.run(_drive(server.url, _prompts(s.requests, s.prompt_tokens, seed), s))
    finally:
        server.stop()
        if store is not None:
            store.stop()


def run(s: Settings, configs: tuple[str, ...] = CONFIGS) -> dict[str, Samples]:
    model = make_model(Path(tempfile.gettempdir()) / f"kvtier-{s.preset}", s.preset)
    out = {c: Samples() for c in configs}
    with tqdm(total=s.repeats * len(configs), desc="servers", unit="server") as bar:
        for repeat in range(s.repeats):
            for config in configs:
                with tempfile.TemporaryDirectory(prefix="kvtier-decode-") as tmp:
                    # the same prompts for every configuration within a repeat
                    results = _serve_once(config, model, Path(tmp), s, seed=repeat)
                samples = out[config]
                samples.tpot_s += [r[0] for r in results]
                samples.ttft_s += [r[1] for r in results]
                samples.per_repeat_tpot_p50.append(statistics.median(r[0] for r in results))
                bar.update()
    return out


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def to_json(report: dict[str, Samples], s: Settings) -> dict:
    return {
        "settings": s.__dict__,
        "configs": {
            c: {
                "tpot_ms": {"p50": 1e3 * _q(x.tpot_s, 0.5), "p90": 1e3 * _q(x.tpot_s, 0.9)},
                "ttft_ms": {"p50": 1e3 * _q(x.ttft_s, 0.5), "p90": 1e3 * _q(x.ttft_s, 0.9)},
                "per_repeat_tpot_p50_ms": [1e3 * v for v in x.per_repeat_tpot_p50],
                "requests": len(x.tpot_s),
            }
            for c, x in report.items()
        },
    }


def print_report(report: dict[str, Samples], s: Settings) -> None:
    from rich.table import Table

    from kvtier.logs import console

    table = Table(
        title=f"decode with and without the connector: {s.requests} distinct {s.prompt_tokens}-"
        f"token prompts x {s.repeats}, {s.concurrency} streams, {s.max_tokens} tokens each"
    )
    columns = ("configuration", "TPOT p50 / p90 ms", "TPOT p50 per repeat ms", "TTFT p50 / p90 ms")
    for col in columns:
        table.add_column(col, justify="right")
    for config, x in report.items():
        table.add_row(
            config,
            f"{1e3 * _q(x.tpot_s, 0.5):.1f} / {1e3 * _q(x.tpot_s, 0.9):.1f}",
            " / ".join(f"{1e3 * v:.1f}" for v in x.per_repeat_tpot_p50),
            f"{1e3 * _q(x.ttft_s, 0.5):.0f} / {1e3 * _q(x.ttft_s, 0.9):.0f}",
        )
    console().print(table)
