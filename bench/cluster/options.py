"""``kvtier bench cluster``: the command's options (the trace, the topology, the model, trace
shaping) and how they become a run (``kvtier.bench.cluster.run``). Registered on ``bench_app`` by
``kvtier.bench.cli``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter

_bytes = TypeAdapter(ByteSize)


def bench_cluster(
    trace: Annotated[
        Path | None, typer.Argument(help="Mooncake or session trace (default: the shared one)")
    ] = None,
    configs: Annotated[
        str | None,
        typer.Option(
            help="vllm-rr, vllm-lmetric, kvtier-hybrid, kvtier-kvtier, lmcache-lmetric (the "
            "default), kvtier-rr, kvtier-lmetric, kvtier-offload "
            "(quick: vllm-rr,vllm-lmetric,kvtier-kvtier)"
        ),
    ] = None,
    nodes: Annotated[int, typer.Option(help="nodes (a store each)")] = 2,
    instances_per_node: Annotated[
        int | None, typer.Option(help="vLLM per node (2; quick 1)")
    ] = None,
    pool: Annotated[str, typer.Option(help="DRAM per node: kvtier pool, LMCache L1")] = "256MiB",
    kv_cache: Annotated[
        str | None,
        typer.Option(help="each instance's KV cache (default: 4096 tokens' worth; quick 2304)"),
    ] = None,
    chunk_tokens: Annotated[int, typer.Option(help="kvtier's and LMCache's chunk")] = 64,
    max_model_len: Annotated[int, typer.Option(help="vLLM's; prompts are capped below it")] = 2048,
    preset: Annotated[
        str | None,
        typer.Option(help="random model preset: tiny | cpu-bench (cpu-bench; quick tiny)"),
    ] = None,
    model: Annotated[Path | None, typer.Option(help="a model dir instead of the preset")] = None,
    block_tokens: Annotated[
        int | None,
        typer.Option(help="tokens sent per trace block (512 in Mooncake): the scale (8; quick 16)"),
    ] = None,
    max_output_tokens: Annotated[int, typer.Option(help="cap on each request's output")] = 16,
    window_seconds: Annotated[
        float | None, typer.Option(help="sampling window (s) (120; quick 20 from 310 s)")
    ] = None,
    window_start: Annotated[
        float | None, typer.Option(help="window start, s from the trace start (default: seeded)")
    ] = None,
    sample_ratio: Annotated[float | None, typer.Option(help="share of sessions kept (0.5)")] = None,
    limit: Annotated[int | None, typer.Option(help="first N sampled requests only")] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="x trace arrival times (0.5 = twice as fast) (0.5)")
    ] = None,
    max_gap: Annotated[
        float | None,
        typer.Option(help="pauses between arrivals longer than this (trace s) shrink to it"),
    ] = None,
    classes: Annotated[str, typer.Option(help="classes by uncached trace tokens")] = (
        "WARM:5000,MEDIUM:20000,HEAVY"
    ),
    timeout: Annotated[float, typer.Option(help="per-request timeout, s")] = 300.0,
    seed: Annotated[int, typer.Option(help="sampling and token seed")] = 0,
    quick: Annotated[
        bool,
        typer.Option(
            help="2 nodes x 1 instance, tiny model, ~40 requests (gaps over 2 s closed), "
            "3 configs: minutes"
        ),
    ] = False,
    out: Annotated[Path, typer.Option(help="folder for JSON, PNG, markdown, per-request")] = Path(
        "results/cluster"
    ),
) -> None:
    """The reference experiment at laptop scale: a sampled, scaled trace through the router of
    a whole cluster per configuration (vLLM alone, kvtier, LMCache), TTFT/TPOT/E2E by class,
    hits by tier, per-instance load, router decision latency."""
    import shlex
    import sys
    import tempfile

    from kvtier.bench.cluster import report as cluster_report
    from kvtier.bench.cluster import run as cluster
    from kvtier.core.errors import KvtierError
    from kvtier.testing.models import ModelInfo, make_model

    chosen = [c.strip() for c in configs.split(",")] if configs else None
    chosen = chosen or list(cluster.QUICK_CONFIGS if quick else cluster.DEFAULT_CONFIGS)
    unknown = [c for c in chosen if c not in cluster.CONFIGS]
    if unknown:
        raise typer.BadParameter(f"unknown configs {unknown}; choose from {list(cluster.CONFIGS)}")
    preset = preset or (cluster.QUICK if quick else cluster.FULL)["preset"]
    model_dir = model or make_model(Path(tempfile.gettempdir()) / f"kvtier-{preset}", preset)
    info = ModelInfo.read(model_dir)
    try:
        plan = cluster.make_plan(
            quick,
            trace=trace,
            window_seconds=window_seconds,
            window_start=window_start,
            sample_ratio=sample_ratio,
            limit=limit,
            time_scale=time_scale,
            max_gap_s=max_gap,
            block_tokens=block_tokens,
            max_model_len=max_model_len,
            max_output_tokens=max_output_tokens,
            classes=classes,
            seed=seed,
        )
        topology = cluster.make_topology(
            quick,
            kv_bytes_per_token=info.kv_bytes_per_token,
            nodes=nodes,
            instances_per_node=instances_per_node,
            pool=pool,
            kv_cache_bytes=int(_bytes.validate_python(kv_cache)) if kv_cache else None,
            chunk_tokens=chunk_tokens,
            max_model_len=max_model_len,
        )
    except (KvtierError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    settings = cluster.ClusterSettings(
        model_dir=Path(model_dir),
        out_dir=out,
        trace=plan,
        topology=topology,
        timeout_s=timeout,
        seed=seed,
        command="kvtier bench cluster " + shlex.join(sys.argv[3:] if len(sys.argv) > 3 else []),
    )
    try:
        report = cluster.run(settings, chosen, say=typer.echo)
    except (KvtierError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    cluster_report.print_report(report)
    (out / "cluster.md").write_text(cluster_report.markdown(report))
    cluster_report.plot(report, out / "cluster.png")
    typer.echo(
        f"wrote {out}/cluster.json, cluster.png, cluster.md (per request: {out}/*/requests.jsonl)"
    )
