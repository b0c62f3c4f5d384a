"""``kvtier bench cluster``: the reference experiment at laptop scale.

A real trace (Mooncake or session format), sampled so cross-session sharing survives and
scaled down so a small CPU machine can serve it (``cluster_trace.py``), is replayed open loop
(each request sent at its timestamp x ``time_scale``, no concurrency limit) through the router
of a whole cluster on this machine (``fleet.py``: index, node stores, vLLM CPU servers,
router), once per configuration, each on freshly started processes:

- ``vllm-rr``: vLLM alone (its own prefix cache), the router's round-robin over static
  backends (nothing announces them, no KV events);
- ``vllm-lmetric``: vLLM alone with KV events on; the index follows every engine's events
  itself (``index serve --vllm``, one namespace made up from the model's geometry) and
  announces their APIs, so the router finds them and ``lmetric`` sees what each GPU holds;
- ``kvtier-hybrid`` / ``kvtier-kvtier``: kvtier's connector and one node store per node (DRAM
  pool, remote tier between nodes); the connector announces each engine and has the index
  follow its KV events; the router's ``hybrid`` or ``kvtier`` policy;
- ``kvtier-rr`` / ``kvtier-lmetric``: the same engines and stores, the router's round-robin
  or ``lmetric`` (what the tiers cost beside other requests, apart from where the ``kvtier``
  policy places them);
- ``lmcache-lmetric``: LMCache 0.5's multiprocess server (``lmcache server``, CPU DRAM L1 the
  size of kvtier's pool) per node and ``LMCacheMPConnector`` in each engine; the index follows
  the engines' KV events as for ``vllm-lmetric`` (LMCache's DRAM is invisible to it).

Same instances, model, trace and per-instance KV cache everywhere. Each instance is warmed up
with a prompt of its own (sharing nothing with the trace) before the counters are read.

Figures per configuration: TTFT / TPOT / E2E p50/p90/p99 overall and per class (the trace's
uncached tokens, ``trace/summary.py``); prefix hits by tier from vLLM's
``vllm:prompt_tokens_cached_by_source`` (device = its GPU cache, host = DRAM through the
connector, p2p = a remote pool; LMCache reports its hits as ``external_unspecified``), summed
over the instances as the delta over the run; per instance its requests, prompt tokens, hit
ratio, and the load imbalance (max / mean); router decision latency from the router's
``kvtier_router_decision_seconds`` histogram (and exactly, from its decision log); errors and
timeouts. Per-request records (``<config>/requests.jsonl``, with the instance that served
each from the router's ``x-kvtier-instance`` header) and ``cluster.json``, ``cluster.png``,
``cluster.md`` (``cluster_report.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.cluster.cpu_usage import CpuMeter
from kvtier.bench.cluster.figures import (
    decision_latency,
    engine_figures,
    hit_split,
    imbalance,
    instance_figures,
    tier_hits,
)
from kvtier.bench.cluster.procs import (
    Peers,
    RoutedReplayer,
    counters,
    get_text,
    wait_routable,
    warm_up,
)
from kvtier.bench.cluster.trace import DEFAULT_TRACE, TracePlan
from kvtier.testing.fleet import Fleet, FleetSpec
from kvtier.testing.models import ModelInfo
from kvtier.testing.vllm_server import MODEL_NAME
from kvtier.traces.formats import TraceFormat
from kvtier.traces.prompts import DEFAULT_CLASSES, parse_classes
from kvtier.traces.replay import (
    ReplayOptions,
    ReplayResult,
    ResultSink,
    TraceReplaySpec,
    trace_items,
)
from kvtier.traces.sample import SampleOptions
from kvtier.traces.server_metrics import parse_prometheus
from kvtier.traces.summary import summarize


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    label: str
    kvtier: bool  # kvtier's connector and node stores
    policy: str
    kv_events: bool  # engines publish KV events (the index follows them)
    peer: str = ""  # "lmcache": LMCache's server per node and its connector
    offload: bool = False  # the router's selective prefill offload (router.offload)


CONFIGS: dict[str, ClusterConfig] = {
    c.name: c
    for c in (
        ClusterConfig("vllm-rr", "vLLM + round-robin", False, "round-robin", False),
        ClusterConfig("vllm-lmetric", "vLLM + lmetric", False, "lmetric", True),
        ClusterConfig("kvtier-hybrid", "kvtier + hybrid", True, "hybrid", True),
        ClusterConfig("kvtier-kvtier", "kvtier + kvtier", True, "kvtier", True),
        # kvtier's connector and stores under round-robin: splits what kvtier's tiers cost a
        # step (the same as kvtier-kvtier) from where the kvtier policy places requests.
        ClusterConfig("kvtier-rr", "kvtier + round-robin", True, "round-robin", True),
        # ... and under lmetric (it scores GPU holdings only): beside vllm-lmetric, what the
        # tiers cost under cache-aware placement; beside kvtier-kvtier, what pricing DRAM and
        # remote runs in the placement buys or costs.
        ClusterConfig("kvtier-lmetric", "kvtier + lmetric", True, "lmetric", True),
        ClusterConfig(
            "kvtier-offload", "kvtier + kvtier + offload", True, "kvtier", True, offload=True
        ),
        ClusterConfig("lmcache-lmetric", "LMCache + lmetric", False, "lmetric", True, "lmcache"),
    )
}
# The comparison a plain run makes (docs/benchmarks-cluster.md); the others are asked for by
# name: kvtier-rr and kvtier-lmetric split the tiers' cost from routing, kvtier-offload adds
# selective offload.
DEFAULT_CONFIGS = ("vllm-rr", "vllm-lmetric", "kvtier-hybrid", "kvtier-kvtier", "lmcache-lmetric")
QUICK_CONFIGS = ("vllm-rr", "vllm-lmetric", "kvtier-kvtier")


@dataclass(frozen=True)
class Topology:
    nodes: int = 2
    instances_per_node: int = 2
    pool: str = "256MiB"  # each node's DRAM: kvtier's store pool, LMCache's L1
    pool_bytes: int = 256 << 20
    kv_cache_bytes: int = 4 << 20  # each engine's "GPU" KV: small, so the working set spills
    block_size: int = 32
    chunk_tokens: int = 64  # kvtier's chunk and LMCache's
    max_model_len: int = 2048
    min_hit_tokens: dict[str, int] = field(default_factory=lambda: {"cpu": 64, "remote": 128})

    @property
    def instances(self) -> int:
        return self.nodes * self.instances_per_node


@dataclass
class ClusterSettings:
    model_dir: Path
    out_dir: Path
    trace: TracePlan = field(default_factory=TracePlan)
    topology: Topology = field(default_factory=Topology)
    timeout_s: float = 300.0  # per request
    seed: int = 0
    command: str = ""


# Defaults (None in make_plan / make_topology): the full comparison, and --quick.
FULL: dict[str, Any] = {  # ~110 requests over ~105 s; ~3 min per configuration
    "window_seconds": 120.0, "window_start": None, "sample_ratio": 0.5, "limit": None,
    "time_scale": 0.5, "max_gap_s": None, "instances_per_node": 2, "block_tokens": 8,
    "preset": "cpu-bench", "kv_cache_tokens": 4096,
}  # fmt: skip
QUICK: dict[str, Any] = {  # ~40 requests, 25 sessions, mostly multi-turn: GPU and DRAM hits
    "window_seconds": 20.0, "window_start": 310.0, "sample_ratio": 0.5, "limit": None,
    "time_scale": 0.5, "max_gap_s": 2.0, "instances_per_node": 1, "block_tokens": 16,
    # Room for one longest prompt (2032 tokens) and little more: a session's returning turn
    # finds its prefix evicted by the 4-6k tokens of other requests since its last turn, so it
    # hits node DRAM (its own node's or, sent elsewhere, the other's), not only the GPU; at
    # 4096 tokens a run saw 576 DRAM-hit tokens on one machine and none on another.
    "preset": "tiny", "kv_cache_tokens": 2304,
}  # fmt: skip


def make_plan(
    quick: bool = False,
    *,
    trace: Path | None = None,
    window_seconds: float | None = None,
    window_start: float | None = None,
    sample_ratio: float | None = None,
    limit: int | None = None,
    time_scale: float | None = None,
    max_gap_s: float | None = None,
    block_tokens: int | None = None,
    max_model_len: int = 2048,
    max_output_tokens: int = 16,
    classes: str = DEFAULT_CLASSES,
    seed: int = 0,
) -> TracePlan:
    d = QUICK if quick else FULL
    return TracePlan(
        path=trace or DEFAULT_TRACE,
        sample=SampleOptions(
            window_seconds=window_seconds or d["window_seconds"],
            window_start_seconds=window_start if window_start is not None else d["window_start"],
            sample_ratio=sample_ratio or d["sample_ratio"],
            seed=seed,
        ),
        limit=limit or d["limit"],
        block_tokens=block_tokens or d["block_tokens"],
        max_prompt_tokens=max_model_len - max_output_tokens,
        max_output_tokens=max_output_tokens,
        time_scale=time_scale or d["time_scale"],
        max_gap_s=max_gap_s or d["max_gap_s"],
        classes=classes,
    )


def make_topology(
    quick: bool = False,
    *,
    kv_bytes_per_token: int,
    nodes: int = 2,
    instances_per_node: int | None = None,
    pool: str = "256MiB",
    kv_cache_bytes: int | None = None,
    kv_cache_tokens: int | None = None,
    chunk_tokens: int = 64,
    max_model_len: int = 2048,
) -> Topology:
    from pydantic import ByteSize, TypeAdapter

    return Topology(
        nodes=nodes,
        instances_per_node=instances_per_node or (QUICK if quick else FULL)["instances_per_node"],
        pool=pool,
        pool_bytes=int(TypeAdapter(ByteSize).validate_python(pool)),
        kv_cache_bytes=kv_cache_bytes
        or (kv_cache_tokens or (QUICK if quick else FULL)["kv_cache_tokens"]) * kv_bytes_per_token,
        chunk_tokens=chunk_tokens,
        max_model_len=max_model_len,
        min_hit_tokens={"cpu": chunk_tokens, "remote": 2 * chunk_tokens},
    )


# -- one configuration ----------------------------------------------------------------------


def fleet_spec(cfg: ClusterConfig, topo: Topology) -> FleetSpec:
    return FleetSpec(
        nodes=topo.nodes,
        instances_per_node=topo.instances_per_node,
        pool=topo.pool,
        kvtier=cfg.kvtier,
        remote=topo.nodes > 1,
        kv_events=cfg.kv_events,
        policy=cfg.policy,
        chunk_tokens=topo.chunk_tokens,
        block_size=topo.block_size,
        kv_cache_bytes=topo.kv_cache_bytes,
        max_model_len=topo.max_model_len,
        connector_extra={"min_hit_tokens": dict(topo.min_hit_tokens)} if cfg.kvtier else {},
        # heavy: an eighth of the longest prompt uncached (the bench's prompts are short:
        # 256 tokens at the default 2,048, about the HEAVY class's floor)
        router_env={
            "KVTIER_ROUTER__OFFLOAD": "true",
            "KVTIER_ROUTER__OFFLOAD_MIN_TOKENS": str(max(topo.max_model_len // 8, 1)),
        }
        if cfg.offload
        else {},
    )


def run_config(
    cfg: ClusterConfig,
    settings: ClusterSettings,
    trace_path: Path,
    say: Callable[[str], None] = lambda _: None,
    on_result: Callable[[ReplayResult], None] | None = None,
) -> dict[str, Any]:
    """Start the configuration, replay the trace through its router, stop it; its figures."""
    topo, plan = settings.topology, settings.trace
    workdir = settings.out_dir / cfg.name
    workdir.mkdir(parents=True, exist_ok=True)
    info = ModelInfo.read(settings.model_dir)
    spec = fleet_spec(cfg, topo)
    peers = Peers(cfg, topo, workdir)
    fleet = Fleet(spec, settings.model_dir, workdir)
    t0 = time.monotonic()
    try:
        peers.start(spec, say)
        fleet.start(say)
        warm_up(fleet, info.vocab_size, 4 * topo.chunk_tokens, settings.seed)
        wait_routable(fleet)
        startup_s = time.monotonic() - t0
        names = {inst.url: inst.name for inst in fleet.instances}
        before = {inst.name: counters(inst.url) for inst in fleet.instances}
        router_before = parse_prometheus(get_text(f"{fleet.router_url}/metrics"), ("le",))
        sink = ResultSink(workdir / "requests.jsonl")
        replay_spec = TraceReplaySpec(
            prompt=plan.prompt_spec(info.vocab_size, settings.seed),
            max_output_tokens=plan.max_output_tokens,
            time_scale=plan.time_scale,
            classes=plan.classes,
        )
        opts = ReplayOptions(url=fleet.router_url, model=MODEL_NAME, timeout_s=settings.timeout_s)
        items = trace_items(trace_path, replay_spec, TraceFormat.SESSION, plan.trace_block_tokens)
        meter = CpuMeter(cpu_roles(fleet, peers), alone=("client",))
        replay_start = time.time()
        load_start = os.getloadavg()[0]
        meter.start()
        try:
            results = asyncio.run(RoutedReplayer(opts, sink, on_result).run(items))
        finally:
            sink.close()
        cpu_s = meter.stop()
        replay_s = time.time() - replay_start
        load_end = os.getloadavg()[0]
        time.sleep(1.5)  # the last requests' counters (vLLM updates them per engine step)
        after = {inst.name: counters(inst.url) for inst in fleet.instances}
        router_after = parse_prometheus(get_text(f"{fleet.router_url}/metrics"), ("le",))
    finally:
        fleet.stop()
        peers.stop()
    for r in results:  # static backends are named by URL
        r.meta["instance"] = names.get(r.meta.get("instance", ""), r.meta.get("instance", ""))
    _rewrite(workdir / "requests.jsonl", results)
    class_names = [c.name for c in parse_classes(plan.classes)]
    report = summarize(results, class_names)
    report.update(
        config=cfg.name,
        label=cfg.label,
        wiring=wiring(cfg),
        startup_s=startup_s,
        replay_s=replay_s,
        load_avg=[load_start, load_end],  # the machine's 1-min load at the replay's ends
        cpu_s=cpu_s,  # CPU seconds by role during the replay
        tiers=tier_hits(before, after),
        instances=instance_figures(before, after, results),
        engines=engine_figures(before, after),
        hit_split=hit_split(results),
        router_decision=decision_latency(router_before, router_after, workdir, replay_start),
    )
    report["imbalance"] = imbalance(report["instances"])
    return report


def cpu_roles(fleet: Fleet, peers: Peers) -> dict[str, list[int]]:
    """The processes of each role, for ``CpuMeter`` (each with its descendants, but
    ``client``: this process, which replays the trace and is the parent of all the others)."""
    roles = {
        "engines": [inst.server.proc.pid for inst in fleet.instances],
        "stores": [store.proc.pid for store in fleet.stores.values()],
        "index": [fleet.index.proc.pid] if fleet.index else [],
        "router": [fleet.router.proc.pid] if fleet.router else [],
        "lmcache": [s.proc.pid for s in peers.servers.values() if s.proc is not None],
        "client": [os.getpid()],
    }
    return {role: pids for role, pids in roles.items() if pids}


def _rewrite(path: Path, results: list[ReplayResult]) -> None:
    from dataclasses import asdict

    with path.open("w") as f:
        for r in sorted(results, key=lambda r: r.index):
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def wiring(cfg: ClusterConfig) -> str:
    if cfg.peer == "lmcache":
        return (
            "LMCache server per node + LMCacheMPConnector; index follows the engines' KV "
            "events (index serve --vllm); router lmetric finds them through the index"
        )
    if cfg.kvtier:
        offload = ", selective prefill offload on" if cfg.offload else ""
        return (
            "kvtier connector + node store per node (remote tier on); the connector announces "
            f"each engine and its KV events to the index; router {cfg.policy}{offload}"
        )
    if cfg.kv_events:
        return (
            "vLLM alone, KV events on; index follows them (index serve --vllm); router "
            f"{cfg.policy} finds the engines through the index"
        )
    return f"vLLM alone; router {cfg.policy} over static --backend URLs"


# -- the whole run --------------------------------------------------------------------------


def run(
    settings: ClusterSettings,
    configs: list[str],
    say: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Prepare the trace, run every configuration in turn, write JSON; the report."""
    from tqdm import tqdm

    from kvtier.bench.cluster.trace import prepare

    info = ModelInfo.read(settings.model_dir)
    topo = settings.topology
    need = (topo.max_model_len + topo.block_size) * info.kv_bytes_per_token
    if topo.kv_cache_bytes < need:
        raise ValueError(
            f"--kv-cache {topo.kv_cache_bytes} B is below one longest request "
            f"({topo.max_model_len} tokens x {info.kv_bytes_per_token} B = {need} B)"
        )
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    trace_path, trace_report = prepare(settings.trace, settings.out_dir, info.vocab_size)
    say(
        f"trace: {trace_report['requests']} requests, {trace_report['sessions']} sessions over "
        f"{trace_report['duration_s']:.0f} s, prompts {trace_report['prompt_tokens']['mean']:.0f} "
        f"tokens mean (x{settings.trace.scale:g} of the trace's)"
    )
    report: dict[str, Any] = {
        "command": settings.command,
        "model": str(settings.model_dir),
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "topology": {**topo.__dict__, "instances": topo.instances},
        "trace": trace_report,
        "configs": {},
        "failed": {},
    }
    n = trace_report["requests"]
    inner = (lambda m: tqdm.write(f"  {m}")) if progress else say
    for name in tqdm(configs, desc="configs", unit="config", disable=not progress):
        try:
            with tqdm(total=n, desc=name, unit="req", leave=False, disable=not progress) as bar:
                result = run_config(
                    CONFIGS[name], settings, trace_path, say=inner,
                    on_result=lambda _: bar.update(),
                )  # fmt: skip
            report["configs"][name] = result
            say(_line(result))
        except Exception as exc:  # one configuration that cannot start does not stop the rest
            report["failed"][name] = f"{type(exc).__name__}: {exc}"
            say(f"{name}: FAILED: {exc}")
        (settings.out_dir / "cluster.json").write_text(json.dumps(report, indent=2))
    return report


def _line(r: dict[str, Any]) -> str:
    ttft = r["ttft_s"]
    p90 = f"{ttft['p90']:.3f}" if ttft["p90"] is not None else "-"
    return (
        f"{r['config']}: {r['ok']}/{r['requests']} ok, TTFT p90 {p90} s, hits "
        f"{r['tiers']['hit_ratio']:.1%} (GPU {r['tiers']['ratio']['device']:.1%}, DRAM "
        f"{r['tiers']['dram_ratio']:.1%}, remote {r['tiers']['ratio']['p2p']:.1%})"
    )
