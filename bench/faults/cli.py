"""`kvtier bench faults`: the fault drills."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def bench_faults(
    requests: Annotated[int, typer.Option(help="requests per drill and phase (>= 100)")] = 100,
    drills: Annotated[
        str | None, typer.Option(help="comma-separated drill names (default: all)")
    ] = None,
    out: Annotated[Path, typer.Option(help="folder for faults.json and faults.md")] = Path(
        "results/faults"
    ),
    model_family: Annotated[
        str, typer.Option(help="architecture of the tiny model: llama, gemma3-swa, ...")
    ] = "llama",
    tensor_parallel_size: Annotated[
        int, typer.Option(help="TP ranks per instance (2 runs on the CPU build)")
    ] = 1,
) -> None:
    """Every failure path through real vLLM instances and stores: wrong tokens, crashes."""
    from rich.table import Table
    from tqdm import tqdm

    from kvtier.bench.faults import run as faults
    from kvtier.bench.faults.drills import DRILLS
    from kvtier.core.logs import console

    names = [d.strip() for d in drills.split(",")] if drills else list(DRILLS)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise typer.BadParameter(f"unknown drills {unknown}; choose from {sorted(DRILLS)}")
    bar = tqdm(total=len(names), unit="drill")

    started: list[str] = []

    def progress(name: str) -> None:  # called as each drill starts
        if started:
            bar.update(1)
        started.append(name)
        bar.set_description(name)

    from kvtier.testing.models import FAMILIES

    if model_family not in FAMILIES:
        raise typer.BadParameter(f"unknown model family; choose from {sorted(FAMILIES)}")
    engine = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    results = faults.run_drills(
        {n: DRILLS[n] for n in names},
        requests,
        progress=progress,
        family=model_family,
        engine_args=engine,
    )
    bar.update(len(started) - bar.n)
    bar.close()
    rows = faults.table(results)
    layout = f", TP {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    table = Table(title=f"fault drills, {model_family}{layout}, {requests} requests per phase")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows[1:]:
        table.add_row(*row)
    console().print(table)
    command = f"kvtier bench faults --requests {requests}" + (
        f" --drills {drills}" if drills else ""
    )
    faults.write(results, out, command)
    typer.echo(f"wrote {out}/faults.json and faults.md")
    bad = [r.drill for r in results if not r.ok]
    if bad:
        typer.echo(f"FAILED drills: {', '.join(bad)}", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add these commands to ``kvtier bench``."""
    app.command("faults")(bench_faults)
