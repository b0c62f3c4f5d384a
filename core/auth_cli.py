"""``kvtier auth``: make credentials for a deployment, written to files (never printed, never
taken as flags): a ``credentials.toml`` the services read (``auth.credentials_file``) and one
``<role>.token`` file per role that a process presents (``auth.token_file``). Mount the
directory as a Kubernetes Secret (``kubectl create secret generic kvtier-credentials
--from-file=DIR``) or a compose secret."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from kvtier.config_auth import Role

auth_app = typer.Typer(no_args_is_help=True, help="Credentials for kvtier's services.")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@auth_app.command("init")
def auth_init(
    out: Annotated[Path, typer.Option(help="directory to write (created 0700)")],
    force: Annotated[bool, typer.Option(help="replace existing credentials")] = False,
) -> None:
    """One random token per role (admin, engine, node, index, reader) and the table of them."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    table = out / "credentials.toml"
    if table.exists() and not force:
        raise typer.BadParameter(f"{table} exists (--force replaces every token)")
    lines = ["# kvtier credentials (docs/security.md): auth.credentials_file", ""]
    for role in Role:
        token = secrets.token_urlsafe(32)
        _write_private(out / f"{role.value}.token", token + "\n")
        lines += [
            "[[credentials]]",
            f'name = "{role.value}"',
            f'token = "{token}"',
            f'role = "{role.value}"',
            "",
        ]
    _write_private(table, "\n".join(lines))
    typer.echo(f"wrote {table} and {len(Role)} token files to {out} (mode 0600)")
