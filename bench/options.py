"""What the ``kvtier bench`` commands share: the ``--json`` option, byte-size parsing and
writing a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter

JsonOut = Annotated[Path | None, typer.Option("--json", help="also write the report here")]
_bytes = TypeAdapter(ByteSize)


def byte_size(value: str) -> int:
    """``"64MiB"`` -> 67108864."""
    return int(_bytes.validate_python(value.strip()))


def parse_sizes(value: str) -> list[int]:
    """A comma-separated list of byte sizes."""
    return [byte_size(v) for v in value.split(",") if v.strip()]


def write_report(report: dict, path: Path | None) -> None:
    """Write ``report`` as JSON to ``path`` (nothing when ``path`` is None)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        typer.echo(f"wrote {path}")
