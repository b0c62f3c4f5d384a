"""``kvtier router``: the front door (``serve``) and the Gateway API endpoint picker (``epp``).
Credentials come from the config file or ``KVTIER_AUTH__*`` (docs/security.md), never flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtier.core.config import load_config
from kvtier.core.logs import setup_logging

router_app = typer.Typer(no_args_is_help=True, help="The cache-, tier- and load-aware router.")
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (or KVTIER_CONFIG)")
]
DiscoverAllowOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="where announced instances may be: HOST[:PORT], CIDR[:PORT], *.domain "
        "(repeatable; router.discover_allow, docs/router.md)"
    ),
]


@router_app.command("serve")
def router_serve(
    config_file: ConfigOpt = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option(help="0 picks a free port")] = None,
    policy: Annotated[str | None, typer.Option(help="kvtier | hybrid | lmetric | ...")] = None,
    backend: Annotated[
        list[str] | None, typer.Option(help="an instance's base URL (repeatable)")
    ] = None,
    index: Annotated[str | None, typer.Option(help="index host:port (instances, holdings)")] = None,
    discover_allow: DiscoverAllowOpt = None,
    model: Annotated[
        str | None, typer.Option(help="tokenizer directory of the served model")
    ] = None,
    decision_log: Annotated[Path | None, typer.Option(help="JSONL of every decision")] = None,
) -> None:
    """Serve the OpenAI API in front of the vLLM instances, routing each request."""
    from kvtier.router.service import serve

    config = load_config(
        config_file,
        **{
            "router.host": host,
            "router.port": port,
            "router.policy": policy,
            "router.backends": [{"url": u} for u in backend] if backend else None,
            "index.address": index,
            "router.discover_allow": discover_allow,
            "router.model": model,
            "router.decision_log": decision_log,
        },
    )
    setup_logging(config)
    serve(config)


@router_app.command("epp")
def router_epp(
    config_file: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(help="gRPC (ext_proc) host")] = None,
    port: Annotated[int | None, typer.Option(help="gRPC port (9002); 0 picks a free one")] = None,
    health_port: Annotated[
        int | None, typer.Option(help="also serve gRPC health, plaintext, on this port")
    ] = None,
    policy: Annotated[str | None, typer.Option(help="kvtier | hybrid | lmetric | ...")] = None,
    backend: Annotated[
        list[str] | None, typer.Option(help="an instance's base URL, http://<pod IP>:<port>")
    ] = None,
    index: Annotated[str | None, typer.Option(help="index host:port (instances, holdings)")] = None,
    discover_allow: DiscoverAllowOpt = None,
    model: Annotated[
        str | None, typer.Option(help="tokenizer directory of the served model")
    ] = None,
    body_mode: Annotated[
        str | None,
        typer.Option(help="the gateway's ext_proc request body mode: full-duplex | buffered"),
    ] = None,
    decision_log: Annotated[Path | None, typer.Option(help="JSONL of every decision")] = None,
) -> None:
    """Serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc gRPC) for an
    InferencePool, choosing each request's pod with the same scoring as ``serve``."""
    from kvtier.router.epp_service import serve

    config = load_config(
        config_file,
        **{
            "router.epp_host": host,
            "router.epp_port": port,
            "router.epp_health_port": health_port,
            "router.policy": policy,
            "router.backends": [{"url": u} for u in backend] if backend else None,
            "index.address": index,
            "router.discover_allow": discover_allow,
            "router.model": model,
            "router.epp_body_mode": body_mode,
            "router.decision_log": decision_log,
        },
    )
    setup_logging(config)
    serve(config)
