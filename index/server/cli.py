"""``kvtier index ...``: run the index, ask it where a prompt is, look at what it follows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtier.core.config import load_config
from kvtier.core.logs import console

index_app = typer.Typer(no_args_is_help=True, help="The global chunk index.")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or KVTIER_CONFIG)")
]
AddressOpt = Annotated[str | None, typer.Option(help="index gRPC host:port")]


def _json_list(values: list[str] | None, what: str) -> list[Any] | None:
    if not values:
        return None
    try:
        return [json.loads(v) for v in values]
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{what}: not JSON: {exc}") from None


@index_app.command("serve")
def serve(
    config_file: ConfigOpt = None,
    backend: Annotated[str | None, typer.Option(help="memory | redis | redis-cluster")] = None,
    redis_url: Annotated[str | None, typer.Option(help="redis://host:port/db")] = None,
    redis_prefix: Annotated[str | None, typer.Option(help="key prefix (one per cluster)")] = None,
    grpc_host: Annotated[str | None, typer.Option()] = None,
    grpc_port: Annotated[int | None, typer.Option(help="0 picks a free port")] = None,
    http_host: Annotated[str | None, typer.Option()] = None,
    http_port: Annotated[int | None, typer.Option(help="0 picks a free port")] = None,
    heartbeat_timeout: Annotated[float | None, typer.Option(help="seconds of silence")] = None,
    probe_interval: Annotated[float | None, typer.Option(help="seconds between probes")] = None,
    vllm: Annotated[
        list[str] | None,
        typer.Option(
            help='a vLLM engine to follow, as JSON: {"instance": .., "endpoint": '
            '"tcp://host:5557", "replay_endpoint": .., "namespaces": [{..}]} (repeatable)'
        ),
    ] = None,
    store: Annotated[
        list[str] | None, typer.Option(help="a node store to follow: host:port (repeatable)")
    ] = None,
) -> None:
    """Run the index: follows vLLM engines and node stores, serves gRPC and HTTP."""
    from kvtier.core.logs import setup_logging
    from kvtier.index.server.service import serve as run

    config = load_config(
        config_file,
        **{
            "index.backend": backend,
            "index.redis_url": redis_url,
            "index.redis_prefix": redis_prefix,
            "index.grpc_host": grpc_host,
            "index.grpc_port": grpc_port,
            "index.http_host": http_host,
            "index.http_port": http_port,
            "index.heartbeat_timeout_s": heartbeat_timeout,
            "index.probe_interval_s": probe_interval,
            "index.vllm": _json_list(vllm, "--vllm"),
            "index.stores": [{"address": a} for a in store] if store else None,
        },
    )
    setup_logging(config)
    run(config)


def _client(config_file: Path | None, address: str | None):  # -> GrpcIndexClient
    from kvtier.core.rpc import ClientAuth
    from kvtier.index.client.grpc import GrpcIndexClient

    config = load_config(config_file, **{"index.address": address})
    target = config.index.address or f"{config.index.grpc_host}:{config.index.grpc_port}"
    # the token comes from the config file or KVTIER_AUTH__TOKEN, never from a flag
    return GrpcIndexClient(target, timeout_s=10, auth=ClientAuth.from_config(config.auth))


def _read_ints(text: str) -> list[int]:
    text = text.strip()
    if text.startswith("["):
        return [int(t) for t in json.loads(text)]
    return [int(t) for t in text.replace(",", " ").split()]


@index_app.command("query")
def query(
    ns: Annotated[str, typer.Option(help="namespace id (32 hex digits)")],
    config_file: ConfigOpt = None,
    address: AddressOpt = None,
    tokens: Annotated[str | None, typer.Option(help="token ids: '1,2,3' or a JSON list")] = None,
    tokens_file: Annotated[
        Path | None, typer.Option(help="file of token ids ('-' = stdin)")
    ] = None,
    keys: Annotated[str | None, typer.Option(help="chunk keys, comma-separated hex")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Which locations hold how much of a prompt (leading runs per tier)."""
    from kvtier.core.errors import KvtierError
    from kvtier.core.keys import keys_from_hex
    from kvtier.index.api import Query
    from kvtier.index.server.http import result_json

    try:
        ns_id = bytes.fromhex(ns)
        if keys is not None:
            q = Query(ns_id, keys=keys_from_hex(k for k in keys.split(",") if k))
        else:
            if tokens_file is not None:
                text = sys.stdin.read() if str(tokens_file) == "-" else tokens_file.read_text()
            elif tokens is not None:
                text = tokens
            else:
                raise typer.BadParameter("give --tokens, --tokens-file or --keys")
            q = Query(ns_id, tokens=_read_ints(text))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    client = _client(config_file, address)
    try:
        result = client.query_one(q)
    except KvtierError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(result_json(result), indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{result.num_chunks} chunks, index {result.health.value}")
    for column in ("location", "kind", "node", "gpu", "cpu", "disk", "total", "stored"):
        table.add_column(column, justify="right" if column in ("gpu", "cpu", "disk") else "left")
    import time

    for h in result.holdings:
        runs = {t.value: n for t, n in h.runs.items()}
        table.add_row(
            h.location, h.kind.value, h.node, str(runs.get("gpu", 0)), str(runs.get("cpu", 0)),
            str(runs.get("disk", 0)), str(h.total), f"{time.time() - h.stored_at:.0f} s ago",
        )  # fmt: skip
    console().print(table)


@index_app.command("stats")
def stats(
    config_file: ConfigOpt = None,
    address: AddressOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """What a running index holds and what it follows."""
    from kvtier.core.errors import KvtierError

    client = _client(config_file, address)
    try:
        data = client.stats()
    except KvtierError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.table import Table

    out = console()
    out.print(f"index health: {data['health']} ({data['health_reason']})")
    backend = Table(title="backend")
    backend.add_column("stat")
    backend.add_column("value", justify="right")
    for key, value in data.get("backend", {}).items():
        backend.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    out.print(backend)
    sources = Table(title="sources")
    for column in ("source", "kind", "state", "batches", "blocks", "gaps rec/lost", "resyncs"):
        sources.add_column(column)
    for s in data.get("sources", []):
        sources.add_row(
            s["source"], s["kind"], s["state"], str(s["batches"]), str(s["blocks"]),
            f"{s['gaps_recovered']}/{s['gaps_lost']}", str(s["resyncs"]),
        )  # fmt: skip
    out.print(sources)
    locations = Table(title="locations")
    for column in ("location", "kind", "node", "status", "gpu", "cpu", "disk"):
        locations.add_column(column)
    for loc in data.get("locations", []):
        e = loc["entries"]
        locations.add_row(
            loc["location"], loc["kind"], loc["node"], loc["status"],
            str(e.get("gpu", 0)), str(e.get("cpu", 0)), str(e.get("disk", 0)),
        )  # fmt: skip
    out.print(locations)
