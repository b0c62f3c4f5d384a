"""``kvtier bench ...``: benchmark commands. Each prints a table and can write JSON; each
family's commands live beside its code (``bench/<family>/cli.py``)."""

from __future__ import annotations

import typer

from kvtier.bench.cluster.options import bench_cluster
from kvtier.bench.engine import cli as engine_cli
from kvtier.bench.faults import cli as faults_cli
from kvtier.bench.knee import cli as knee_cli
from kvtier.bench.micro import cli as micro_cli

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against floors and peers.")

micro_cli.register(bench_app)
engine_cli.register(bench_app)
knee_cli.register(bench_app)
faults_cli.register(bench_app)
bench_app.command("cluster")(bench_cluster)
