"""The ``kvtier`` command line. Every command reads the one config model (file < env < flags)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvtier import __version__
from kvtier.bench.cli import bench_app
from kvtier.core.auth_cli import auth_app
from kvtier.core.config import load_config
from kvtier.core.config_cli import config_app
from kvtier.core.logs import console, setup_logging
from kvtier.index.server.cli import index_app
from kvtier.router.cli import router_app
from kvtier.traces.cli import trace_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
store_app = typer.Typer(no_args_is_help=True, help="The per-node DRAM store.")
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")
app.add_typer(index_app, name="index")
app.add_typer(auth_app, name="auth")
app.add_typer(router_app, name="router")
app.add_typer(config_app, name="config")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or KVTIER_CONFIG)")
]


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
    unix_socket: Annotated[
        Path | None, typer.Option(help="also serve the node's engines on this Unix socket")
    ] = None,
) -> None:
    """Run the node store: owns the shared-memory pool, serves gRPC control and HTTP health.
    Credentials come from the config file or KVTIER_AUTH__* (docs/security.md), never flags."""
    from kvtier.store.server.service import serve

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
            "index.address": index,
            "store.advertise_address": advertise,
            "store.unix_socket": unix_socket,
        },
    )
    setup_logging(config)
    serve(config)


@store_app.command("stats")
def store_stats(
    config_file: ConfigOpt = None,
    address: Annotated[str | None, typer.Option(help="store gRPC host:port or unix:/path")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Print a running store's statistics."""
    from kvtier.core.rpc import ClientAuth
    from kvtier.store.client.grpc import GrpcStoreClient

    config = load_config(config_file, **{"store.address": address})
    target = config.store.address or f"{config.store.grpc_host}:{config.store.grpc_port}"
    # the token comes from the config file or KVTIER_AUTH__TOKEN, never from a flag
    client = GrpcStoreClient(target, timeout_s=5, auth=ClientAuth.from_config(config.auth))
    try:
        stats = client.stats()
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"kvtier store {target}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    console().print(table)


@store_app.command("demo")
def store_demo(
    address: Annotated[str | None, typer.Option(help="store host:port; unset = embedded")] = None,
    chunks: Annotated[int, typer.Option(help="chunks to put and get")] = 64,
) -> None:
    """Put chunks into a store and read them back through shared memory."""
    from kvtier.demo.pool_client import run_demo

    report = run_demo(address, chunks=chunks)
    for line in report.lines():
        typer.echo(line)
    if not report.verified:
        raise typer.Exit(1)


@app.command()
def demo(
    instances_per_node: Annotated[int, typer.Option(help="vLLM instances on each node")] = 2,
    prompt_tokens: Annotated[int, typer.Option(help="length of the demonstration prompt")] = 2048,
    workdir: Annotated[Path | None, typer.Option(help="where models, logs, pools live")] = None,
    keep_running: Annotated[
        bool, typer.Option(help="keep the cluster serving afterwards (Ctrl-C ends)")
    ] = True,
) -> None:
    """Start a small kvtier cluster here (index, two node stores, vLLM CPU instances, the
    router) and show one prompt as a miss, a GPU hit, a node-DRAM hit and a remote hit."""
    from kvtier.demo.cluster import run

    steps = run(workdir, instances_per_node, prompt_tokens, keep_running, typer.echo)
    if steps and not all(s.ok for s in steps):
        raise typer.Exit(1)


def main() -> None:
    app()
