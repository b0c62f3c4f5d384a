"""Small trace builders shared by the trace tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SHARED_TRACE = Path("/work/shared/data/traces/mooncake_synthetic_trace.jsonl")


def req(
    ts: float,
    hash_ids: list[int],
    out: int = 4,
    input_length: int | None = None,
    session: str | None = None,
    turn: int | None = None,
    block: int = 512,
) -> dict:
    """A trace line whose input fills its blocks (minus 10 tokens of the last one)."""
    if input_length is None:
        input_length = max(len(hash_ids) * block - 10, 0)
    line: dict = {}
    if session is not None:
        line["session_id"] = session
        line["turn"] = turn
    line.update(
        {"timestamp": ts, "input_length": input_length, "output_length": out, "hash_ids": hash_ids}
    )
    return line


def write_trace(path: Path, lines: Iterable[dict]) -> Path:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return path


def shared_lines() -> list[dict]:
    return [json.loads(line) for line in SHARED_TRACE.read_text().splitlines() if line.strip()]
