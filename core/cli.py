"""The ``kvtier`` command line. Every command reads the one config model (file < env < flags)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvtier import __version__
from kvtier.bench.cli import bench_app
from kvtier.bench.trace.cli import trace_app
from kvtier.config import KvtierConfig, load_config
from kvtier.index.cli import index_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
store_app = typer.Typer(no_args_is_help=True, help="The per-node DRAM store.")
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")
app.add_typer(index_app, name="index")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or KVTIER_CONFIG)")
]


def _setup_logging(config: KvtierConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.command()
def version() -> None:
    """Print kvtier's version."""
    typer.echo(__version__)


@store_app.command("serve")
def store_serve(
    config_file: ConfigOpt = None,
    node_id: Annotated[str | None, typer.Option(help="identity in events and metrics")] = None,
    grpc_host: Annotated[str | None, typer.Option()] = None,
    grpc_port: Annotated[int | None, typer.Option(help="0 picks a free port")] = None,
    http_host: Annotated[str | None, typer.Option()] = None,
    http_port: Annotated[int | None, typer.Option(help="0 picks a free port")] = None,
    capacity: Annotated[str | None, typer.Option(help="pool size, e.g. 8GiB")] = None,
    page_size: Annotated[str | None, typer.Option(help="allocation unit, e.g. 64KiB")] = None,
    eviction: Annotated[str | None, typer.Option(help="lru | s3fifo")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="lock files for crash cleanup")] = None,
    remote: Annotated[
        bool | None, typer.Option("--remote/--no-remote", help="serve/fetch peers (Mooncake)")
    ] = None,
    remote_host: Annotated[str | None, typer.Option(help="address peers reach this node at")] = (
        None
    ),
    peers: Annotated[
        str | None, typer.Option(help="peer stores' gRPC host:port, comma-separated")
    ] = None,
    demotion: Annotated[str | None, typer.Option(help="none | peers")] = None,
    index: Annotated[
        str | None, typer.Option(help="index host:port to announce this store to")
    ] = None,
    advertise: Annotated[
        str | None, typer.Option(help="host:port others reach this store's gRPC at")
    ] = None,
) -> None:
    """Run the node store: owns the shared-memory pool, serves gRPC control and HTTP health."""
    from kvtier.store.service import serve

    config = load_config(
        config_file,
        **{
            "store.node_id": node_id,
            "store.grpc_host": grpc_host,
            "store.grpc_port": grpc_port,
            "store.http_host": http_host,
            "store.http_port": http_port,
            "store.pool.capacity": capacity,
            "store.pool.page_size": page_size,
            "store.pool.eviction": eviction,
            "store.run_dir": run_dir,
            "store.remote.enabled": remote,
            "store.remote.hostname": remote_host,
            "store.remote.peers": [p.strip() for p in peers.split(",") if p.strip()]
            if peers is not None
            else None,
            "store.remote.demotion.policy": demotion,
            "store.index_address": index,
            "store.advertise_address": advertise,
        },
    )
    _setup_logging(config)
    serve(config)


@store_app.command("stats")
def store_stats(
    config_file: ConfigOpt = None,
    address: Annotated[str | None, typer.Option(help="store gRPC host:port")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Print a running store's statistics."""
    from kvtier.store.grpc_client import GrpcStoreClient

    config = load_config(config_file, **{"store.address": address})
    target = config.store.address or f"{config.store.grpc_host}:{config.store.grpc_port}"
    client = GrpcStoreClient(target, timeout_s=5)
    try:
        stats = client.stats()
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier store {target}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    Console().print(table)


@store_app.command("demo")
def store_demo(
    address: Annotated[str | None, typer.Option(help="store host:port; unset = embedded")] = None,
    chunks: Annotated[int, typer.Option(help="chunks to put and get")] = 64,
) -> None:
    """Put chunks into a store and read them back through shared memory."""
    from kvtier.store.demo import run_demo

    report = run_demo(address, chunks=chunks)
    for line in report.lines():
        typer.echo(line)
    if not report.verified:
        raise typer.Exit(1)


@app.command()
def demo(
    config_file: ConfigOpt = None,
    keep_running: Annotated[
        bool, typer.Option(help="keep the store serving after the demonstration (Ctrl-C ends)")
    ] = True,
) -> None:
    """Start a node store on embedded defaults and show a second process using its pool."""
    config = load_config(config_file)
    cmd = [sys.executable, "-m", "kvtier", "store", "serve", "--grpc-port", "0", "--http-port", "0"]
    if config_file is not None:
        cmd += ["--config", str(config_file)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            raise typer.Exit(server.wait() or 1)
        ready = json.loads(line)
        typer.echo(
            f"store {ready['node_id']} serving: gRPC {ready['grpc']}, HTTP "
            f"http://{ready['http']}/metrics, pool /dev/shm/{ready['segment']} "
            f"({ready['capacity_bytes'] >> 20} MiB, {config.store.pool.eviction})"
        )
        typer.echo("a second process puts chunks into the pool and reads them back:")
        client = subprocess.run(
            [sys.executable, "-m", "kvtier", "store", "demo", "--address", ready["grpc"]],
            check=False,
        )
        if client.returncode:
            raise typer.Exit(client.returncode)
        if keep_running:
            typer.echo(
                f"store keeps serving; try: kvtier store stats --address {ready['grpc']}"
                "   (Ctrl-C to stop)"
            )
            while server.poll() is None:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=15)
    typer.echo("store stopped; shared memory released")


def main() -> None:
    app()
