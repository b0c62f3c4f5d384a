"""``kvtier auth``: make credentials for a deployment, written to files (never printed, never
taken as flags): a ``credentials.toml`` the services read (``auth.credentials_file``) and one
``<role>.token`` file per role that a process presents (``auth.token_file``). Mount the
directory as a Kubernetes Secret (``kubectl create secret generic kvtier-credentials
--from-file=DIR``) or a compose secret."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from kvtier.core.config.auth import Role

auth_app = typer.Typer(no_args_is_help=True, help="Credentials for kvtier's services.")


def _private_dir(out: Path) -> None:
    """``out`` created 0700, or made 0700: the tokens must not be readable by others even for
    the moment before each file's own mode applies, nor listed, renamed or swapped (others
    could otherwise replace a token file between two runs). Refused when this uid cannot
    make it private: not a directory, or another uid's."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = out.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise typer.BadParameter(
            f"{out}: not a directory owned by uid {os.getuid()}; credentials go in a "
            "directory of their own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        out.chmod(0o700)
        typer.echo(f"{out}: mode {mode:o} -> 700 (credentials: this uid only)")


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` 0600, atomically: a temporary file created 0600 in the same directory,
    then renamed over ``path``. An existing file keeps no mode of its own (a 0644 token
    file would otherwise keep 0644 through a truncate-and-write), and a reader never sees
    half a token."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: O_EXCL, mode 0600 whatever the umask
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@auth_app.command("init")
def auth_init(
    out: Annotated[Path, typer.Option(help="directory to write (made 0700)")],
    force: Annotated[bool, typer.Option(help="replace existing credentials")] = False,
) -> None:
    """One random token per role (admin, engine, node, index, reader) and the table of them."""
    table = out / "credentials.toml"
    if table.exists() and not force:
        raise typer.BadParameter(f"{table} exists (--force replaces every token)")
    _private_dir(out)
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
