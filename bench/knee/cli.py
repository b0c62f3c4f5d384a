"""`kvtier bench knee`: hit ratio and TTFT against GPU KV capacity and DRAM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

KNEE_WORKLOADS = {  # preset -> (user tokens, output tokens) per turn
    "tiny": (224, 32),
    "cpu-bench": (480, 32),
}


def bench_knee(
    preset: Annotated[str, typer.Option(help="random model preset: tiny | cpu-bench")] = "tiny",
    model: Annotated[
        Path | None, typer.Option(help="a model dir instead of the preset (Llama-like)")
    ] = None,
    sessions: Annotated[int, typer.Option(help="S: concurrent sessions")] = 4,
    turns: Annotated[int | None, typer.Option(help="T: turns per session (6; quick: 4)")] = None,
    user_tokens: Annotated[
        int | None, typer.Option(help="U: new user tokens per turn (tiny 224, cpu-bench 480)")
    ] = None,
    output_tokens: Annotated[
        int | None, typer.Option(help="O: output tokens per turn (32)")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="GPU KV capacities, multiples of S*W (0.25,0.5,0.75,1,1.5,2)"),
    ] = None,
    gpu_blocks: Annotated[
        str | None, typer.Option(help="GPU KV capacities in blocks (instead of --gpu)")
    ] = None,
    dram: Annotated[
        str | None,
        typer.Option(help="DRAM tiers: none (no connector), a multiple of S*W or a size (none,2)"),
    ] = None,
    chunk_tokens: Annotated[int, typer.Option(help="kvtier chunk (tokens)")] = 32,
    disk: Annotated[
        str | None,
        typer.Option(
            help="give every DRAM configuration the node's disk tier (docs/disk.md): "
            "write-back or write-through"
        ),
    ] = None,
    fraction: Annotated[float, typer.Option(help="knee: this share of the best hit ratio")] = 0.9,
    seed: Annotated[int, typer.Option()] = 0,
    quick: Annotated[
        bool, typer.Option(help="4 turns, GPU 0.5,1.5 x S*W, DRAM none,2: ~3 minutes")
    ] = False,
    out: Annotated[Path, typer.Option(help="folder for JSON, PNG, per-request results")] = Path(
        "results/knee"
    ),
    report_json: Annotated[
        Path | None,
        typer.Option("--report", help="print and plot a saved knee.json again (runs nothing)"),
    ] = None,
) -> None:
    """Hit ratio by tier and TTFT vs GPU KV capacity (and DRAM): the knee, beside S*W."""
    import tempfile

    from kvtier.bench.knee import report as knee_report
    from kvtier.bench.knee import run as knee
    from kvtier.bench.knee.results import KneeReport
    from kvtier.bench.knee.workload import Workload
    from kvtier.core.errors import KvtierError
    from kvtier.testing.models import ModelInfo, make_model

    if report_json is not None:
        saved = KneeReport.from_json(json.loads(report_json.read_text()))
        knee_report.print_report(saved)
        knee_report.plot(saved, report_json.with_suffix(".png"))
        typer.echo(f"wrote {report_json.with_suffix('.png')}")
        return
    if model is None and preset not in KNEE_WORKLOADS:
        raise typer.BadParameter(f"preset must be one of {sorted(KNEE_WORKLOADS)}")
    u, o = KNEE_WORKLOADS.get(preset, KNEE_WORKLOADS["tiny"])
    model_dir = model or make_model(Path(tempfile.gettempdir()) / f"kvtier-{preset}", preset)
    info = ModelInfo.read(model_dir)
    try:
        workload = Workload(
            sessions=sessions,
            turns=turns or (4 if quick else 6),
            user_tokens=user_tokens or u,
            output_tokens=output_tokens or o,
            vocab_size=info.vocab_size,
            seed=seed,
        )
        if workload.max_model_len > info.max_positions:
            raise typer.BadParameter(
                f"the last turn needs {workload.max_model_len} tokens; the model takes "
                f"{info.max_positions}: fewer turns or tokens"
            )
        if gpu_blocks:
            blocks = [int(b) for b in gpu_blocks.split(",") if b.strip()]
        else:
            spec = gpu or ("0.5,1.5" if quick else "0.25,0.5,0.75,1,1.5,2")
            blocks = knee.gpu_blocks_for([float(m) for m in spec.split(",")], workload)
        drams = [
            knee.dram_bytes_for(d, workload, info.kv_bytes_per_token)
            for d in (dram or "none,2").split(",")
        ]
        configs = knee.grid(blocks, drams)
        if disk not in (None, "write-back", "write-through"):
            raise typer.BadParameter(f"--disk {disk!r}: write-back or write-through")
        settings = knee.RunSettings(
            model_dir=Path(model_dir),
            info=info,
            out_dir=out,
            chunk_tokens=chunk_tokens,
            disk=disk,
        )
        knee.check_configs(configs, workload)
    except (KvtierError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(
        f"{len(configs)} configurations, a fresh vLLM server each (~30 s to start on 2 cores); "
        + knee_report.headline(knee.workload_json(workload, settings))
    )
    report = knee.run(workload, configs, settings, fraction, preset=None if model else preset)
    knee_report.print_report(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "knee.json").write_text(json.dumps(report.to_json(), indent=2))
    knee_report.plot(report, out / "knee.png")
    typer.echo(f"wrote {out}/knee.json and knee.png (per-request results: {out}/*.jsonl)")


def register(app: typer.Typer) -> None:
    """Add these commands to ``kvtier bench``."""
    app.command("knee")(bench_knee)
