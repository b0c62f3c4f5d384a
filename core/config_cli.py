"""``kvtier config``: the one config model, from the outside. ``show`` prints what a service
started here would read (file, environment) and where each value came from; ``docs`` writes
the reference (docs/configuration.md) from the model itself."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

config_app = typer.Typer(no_args_is_help=True, help="The configuration: show it, document it.")


@config_app.command("show")
def config_show(
    config_file: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML config file (or KVTIER_CONFIG)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of TOML")] = False,
) -> None:
    """Print the effective config and each value's source; secrets redacted.

    Reads what a service started here would: defaults < file (--config or KVTIER_CONFIG) <
    KVTIER_* environment. Sources: default, file PATH, env KVTIER_..., flag."""
    from kvtier.core.config.reference import show

    typer.echo(show(config_file, as_json=as_json), nl=as_json)


@config_app.command("docs")
def config_docs(
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="write here (docs/configuration.md) instead of stdout"),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="with --output: fail if the file differs, write nothing")
    ] = False,
) -> None:
    """The configuration reference, generated from the config model (markdown)."""
    from kvtier.core.config.reference import REGENERATE, render_markdown

    text = render_markdown()
    if output is None:
        typer.echo(text, nl=False)
        return
    if check:
        current = output.read_text() if output.is_file() else ""
        if current != text:
            typer.echo(f"{output} is out of date: run `{REGENERATE}`", err=True)
            raise typer.Exit(1)
        return
    output.write_text(text)
    typer.echo(f"wrote {output}")
