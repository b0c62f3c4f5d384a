"""Chunk keys outside this process: docs/keys/reference.c, compiled, gives the spec's vectors,
and fresh interpreters with other hash seeds give the same keys (the spec's vectors, edge
cases and the keyer in-process: tests/unit/core/test_keys.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "keys"
VECTORS = json.loads((DOCS / "vectors.json").read_text())


def test_c_reference_implementation_agrees(tmp_path: Path) -> None:
    """docs/keys/reference.c, written from the spec alone, gives the same keys."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (CI installs build-essential)"
    binary = tmp_path / "chunk_keys"
    subprocess.run([cc, "-O2", "-o", str(binary), str(DOCS / "reference.c")], check=True)
    for vector in VECTORS:
        media = vector.get("media", [])
        items = " ".join(
            f"{m['offset']} {m['length']} {m['identifier'].encode().hex()}" for m in media
        )
        stdin = (
            f"{vector['namespace']['chunk_tokens']}\n"
            f"{vector['canonical'].encode().hex()}\n"
            f"{len(media)} {items}\n"
            f"{' '.join(map(str, vector['tokens']))}\n"
        )
        out = subprocess.run(
            [str(binary)], input=stdin, capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == [vector["root"], *vector["keys"]], vector["name"]


def test_independent_of_python_hash_seed() -> None:
    code = (
        "from kvtier.core.keys import Namespace, prompt_keys;"
        "ns = Namespace(model='m', dtype='f', num_layers=1, num_kv_heads=1, head_size=1);"
        "print(prompt_keys(ns, list(range(1000)))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "random")
    }
    assert len(outs) == 1
