"""What kvtier's connector costs a decode step: one vLLM server, the same streamed workload,
with and without the connector.

    kvtier bench decode-overhead [--repeats 2] [--requests 48] [--concurrency 8]

Configurations, each a freshly started OpenAI server (the ``cpu-bench`` model, 32 MiB of KV),
interleaved repeat by repeat so a machine's drift hits all of them alike:

- ``vllm``: no KV connector (the floor);
- ``vllm-noop``: a connector that does nothing (``kvtier.testing.noop_connector``): what
  merely configuring a connector changes in vLLM, so kvtier's own cost is the difference
  from this row;
- ``kvtier-embedded``: kvtier's connector with an embedded store in the engine process;
- ``kvtier-store``: kvtier's connector with a node store process (its hot path on the store's
  control socket, misses answered from its shared view: ``store.fast_control``);
- ``kvtier-store-grpc``: the same with every call over gRPC on loopback (the path before
  ``store.fast_control``, kept to compare);
- ``kvtier-store-held``: ``kvtier-store`` with pool space held ahead for saves
  (``save_held_chunks = 32``; unset, a full-attention model holds none: every save asks the
  store and goes out a step later);
- ``kvtier-store-asked``: ``kvtier-store`` holding none (``save_held_chunks = 0``): what
  held space changes for a model that holds it unset (``--preset cpu-bench-swa``, a sliding
  window: prompts longer than its 1,024 tokens let the window free blocks).

The workload: ``requests`` distinct random prompts (every one a miss, so every prompt's
chunks are saved while other requests decode), ``concurrency`` streams at a time,
``max_tokens`` generated each (``ignore_eos``), sent by the trace replayer's closed loop
(``trace/replay.py``: TTFT and TPOT per request on the client's clock, summarised by
``trace/summary.py``). A warm-up batch runs first. Beside TPOT it reports, from vLLM's
``/metrics``, the engine steps of the measured runs and the ms per step the engine spent in
kvtier's hooks (``vllm:kvtier_{scheduler,worker}_hook_seconds``), and the CPU seconds the
server's processes (API server, engine, workers) and the node store spent on the measured
runs (``/proc``: user + system), per request. The engine's figure includes vLLM's own
processes polling for work, which grows with a run's wall time: it follows TPOT more than it
isolates the connector's work; the store's figure is the store's work alone. With a node store,
also the messages its control socket received per engine step and the calls they carried
(``control_messages`` / ``control_calls`` in the store's stats: a step's batch is one message).

The question it answers: does the connector's per-step work (save planning, copies into the
pool) slow decoding? It isolates the connector from a cluster's other processes (router,
index, several engines on the same cores), which ``kvtier bench cluster`` cannot.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from tqdm import tqdm

from kvtier.bench.cluster.figures import engine_figures, ms_per_step
from kvtier.bench.cluster.procs import counters
from kvtier.testing import noop_connector
from kvtier.testing.models import make_model
from kvtier.testing.services import start_store, store_stats
from kvtier.testing.vllm_driver import kvtier_transfer_config
from kvtier.testing.vllm_server import MODEL_NAME, VllmServer
from kvtier.traces.replay import Replayer, ReplayItem, ReplayOptions, ReplayResult
from kvtier.traces.summary import summarize

CONFIGS = (
    "vllm",
    "vllm-noop",
    "kvtier-embedded",
    "kvtier-store",
    "kvtier-store-grpc",
    "kvtier-store-held",
    "kvtier-store-asked",
)


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


# the connector's counters of what the saves became (vllm:kvtier_<name>): the table shows
# the first two, the JSON report all
SAVE_COUNTERS = (
    "committed_chunks",
    "save_errors",
    "saved_chunks",
    "save_allocated",
    "save_deferred",
    "save_no_space",
    "save_alloc_timeouts",
    "save_held_space",
    "save_held_duplicates",
    "save_held_short",
)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """A kvtier counter's growth over the run (prometheus_client's ``_total`` or not)."""
    key = f"vllm:kvtier_{name}"
    return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in (key, f"{key}_total"))


@dataclass
class Samples:
    results: list[ReplayResult] = field(default_factory=list)  # every repeat's, pooled
    per_repeat_tpot_p50: list[float] = field(default_factory=list)
    steps: float = 0.0  # engine steps of the measured runs
    hook_s: dict[str, float] = field(default_factory=lambda: {"scheduler": 0.0, "worker": 0.0})
    saves: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SAVE_COUNTERS, 0.0))
    cpu_s: dict[str, float] = field(default_factory=lambda: {"engine": 0.0, "store": 0.0})
    control: dict[str, float] = field(default_factory=lambda: {"messages": 0.0, "calls": 0.0})

    def control_per_step(self) -> dict[str, float]:
        """Control-socket messages and calls per engine step (0 without a node store)."""
        return {k: v / self.steps if self.steps else 0.0 for k, v in self.control.items()}

    def cpu_ms_per_request(self) -> dict[str, float]:
        n = len(self.results)
        return {who: 1e3 * seconds / n if n else 0.0 for who, seconds in self.cpu_s.items()}

    def hook_ms_per_step(self) -> dict[str, float]:
        """What the engine spent in kvtier's hooks per step, as vLLM's metrics say."""
        return ms_per_step(self.hook_s, self.steps)


def _replay(url: str, prompts: list[list[int]], s: Settings) -> list[ReplayResult]:
    """The trace replayer's closed loop: ``concurrency`` streams, TTFT / TPOT per request."""
    opts = ReplayOptions(url=url, model=MODEL_NAME, concurrency=s.concurrency)
    items = [
        ReplayItem(i, 0.0, s.max_tokens, functools.partial(list, prompt))
        for i, prompt in enumerate(prompts)
    ]
    results = asyncio.run(Replayer(opts).run(items))
    failed = [r for r in results if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {failed[0].error}")
    return results


def _cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` and every descendant alive now
    (the processes a server starts live as long as it does)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def _control(store: Any) -> dict[str, float]:
    """The node store's control-socket counts now (zeros without a store)."""
    stats = store_stats(store.address, store.pid) if store is not None else None
    stats = stats or {}
    return {
        "messages": float(stats.get("control_messages", 0)),
        "calls": float(stats.get("control_calls", 0)),
    }


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(tokens)] for _ in range(n)]


def _serve_once(
    config: str, model: Path, workdir: Path, s: Settings, seed: int
) -> tuple[list[ReplayResult], dict[str, Any]]:
    """Start ``config``'s server, warm it up, run the workload, stop everything; the results
    and the engine's steps and hook time during the workload (``engine_figures``)."""
    store = None
    extra_args: list[str] = []
    if config == "vllm-noop":
        extra_args = ["--kv-transfer-config", json.dumps(noop_connector.TRANSFER_CONFIG)]
    elif config != "vllm":
        extra: dict[str, Any] = {"chunk_tokens": 64, "store": {"pool": {"capacity": s.pool}}}
        if config.startswith("kvtier-store"):
            store = start_store(workdir, s.pool, "decode-bench", remote=False)
            extra = {"chunk_tokens": 64, "store_address": store.address}
            if config == "kvtier-store-grpc":
                extra["store"] = {"fast_control": False}
            if config == "kvtier-store-held":
                extra["save_held_chunks"] = 32
            if config == "kvtier-store-asked":
                extra["save_held_chunks"] = 0
        extra_args = ["--kv-transfer-config", json.dumps(kvtier_transfer_config(extra))]
    server = VllmServer(
        model, workdir / f"{config}.log", kv_cache_bytes=s.kv_cache_bytes, extra_args=extra_args,
        env={"KVTIER_STORE__RUN_DIR": str(workdir)},
    )  # fmt: skip
    try:
        server.wait_ready()
        _replay(server.url, _prompts(s.concurrency, s.prompt_tokens, 10**6 + seed), s)  # warm-up
        before = counters(server.url)
        store_pids = [store.pid] if store is not None else []
        cpu_before = _cpu_seconds([server.proc.pid]), _cpu_seconds(store_pids)
        control_before = _control(store)
        results = _replay(server.url, _prompts(s.requests, s.prompt_tokens, seed), s)
        time.sleep(1.0)  # vLLM's front end has the last steps' stats
        after = counters(server.url)
        cpu_after = _cpu_seconds([server.proc.pid]), _cpu_seconds(store_pids)
        control_after = _control(store)
        engine = engine_figures({"e": before}, {"e": after})
        engine["saves"] = {name: _delta(before, after, name) for name in SAVE_COUNTERS}
        engine["cpu_s"] = {
            "engine": cpu_after[0] - cpu_before[0],
            "store": cpu_after[1] - cpu_before[1],
        }
        engine["control"] = {k: control_after[k] - control_before[k] for k in control_after}
        return results, engine
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
                    results, engine = _serve_once(config, model, Path(tmp), s, seed=repeat)
                samples = out[config]
                samples.results += results
                samples.steps += engine["steps"]
                for role, seconds in engine["hook_seconds"].items():
                    samples.hook_s[role] += seconds
                for name, n in engine["saves"].items():
                    samples.saves[name] += n
                for who, seconds in engine["cpu_s"].items():
                    samples.cpu_s[who] += seconds
                for what, n in engine["control"].items():
                    samples.control[what] += n
                samples.per_repeat_tpot_p50.append(
                    statistics.median(r.tpot_s for r in results if r.tpot_s is not None)
                )
                bar.update()
    return out


def _figures(x: Samples) -> dict[str, Any]:
    """p50 / p90 ms of TPOT, TTFT and E2E over every repeat's requests (the replay's
    summary)."""
    summary = summarize(x.results)
    return {
        metric: {q: 1e3 * summary[f"{metric}_s"][q] for q in ("p50", "p90")}
        for metric in ("tpot", "ttft", "e2e")
    }


def to_json(report: dict[str, Samples], s: Settings) -> dict:
    return {
        "settings": s.__dict__,
        "configs": {
            c: {
                **{f"{m}_ms": v for m, v in _figures(x).items()},
                "per_repeat_tpot_p50_ms": [1e3 * v for v in x.per_repeat_tpot_p50],
                "requests": len(x.results),
                "engine_steps": x.steps,
                "hook_ms_per_step": x.hook_ms_per_step(),
                "saves": x.saves,
                "cpu_ms_per_request": x.cpu_ms_per_request(),
                "control_per_step": x.control_per_step(),
            }
            for c, x in report.items()
        },
    }


def print_report(report: dict[str, Samples], s: Settings) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"decode with and without the connector: {s.requests} distinct {s.prompt_tokens}-"
        f"token prompts x {s.repeats}, {s.concurrency} streams, {s.max_tokens} tokens each"
    )
    columns = (
        "configuration", "TPOT p50 / p90 ms", "TPOT p50 per repeat ms", "TTFT p50 / p90 ms",
        "E2E p50 / p90 ms", "steps", "kvtier hooks ms / step (scheduler / worker)",
        "chunks committed / save errors", "CPU ms / request (engine / store)",
        "store messages / calls per step",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for config, x in report.items():
        f = _figures(x)
        table.add_row(
            config,
            f"{f['tpot']['p50']:.1f} / {f['tpot']['p90']:.1f}",
            " / ".join(f"{1e3 * v:.1f}" for v in x.per_repeat_tpot_p50),
            f"{f['ttft']['p50']:.0f} / {f['ttft']['p90']:.0f}",
            f"{f['e2e']['p50']:.0f} / {f['e2e']['p90']:.0f}",
            f"{x.steps:.0f}",
            " / ".join(f"{v:.2f}" for v in x.hook_ms_per_step().values()),
            " / ".join(f"{x.saves[name]:.0f}" for name in SAVE_COUNTERS[:2]),
            " / ".join(f"{v:.1f}" for v in x.cpu_ms_per_request().values()),
            " / ".join(f"{v:.2f}" for v in x.control_per_step().values()),
        )
    console().print(table)
