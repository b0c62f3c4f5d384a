"""Chunk keys per second for a long prompt, by hash function and token container.

    python -m kvtier bench keys [--tokens 131072]

SHA-256 truncated to 16 bytes is the spec's hash since spec 3 (docs/keys/spec.md); XXH3-128
(spec 2's hash, not collision resistant against crafted prompts) and BLAKE3 are measured the
same way (same chaining, same bytes) to show what the choice costs. Token ids arrive as a
Python list from a tokenizer or a request, or as a numpy array from an engine; both are timed
through ``prompt_keys`` (the spec's implementation), since converting a 128k-element list costs
more than hashing it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from kvtier.bench.micro.timing import best_of
from kvtier.core.keys import Namespace, prompt_keys

Digest = Callable[[bytes], bytes]


def _digests() -> dict[str, Digest]:
    out: dict[str, Digest] = {
        "sha256[:16] (spec 3)": lambda data: hashlib.sha256(data).digest()[:16],
        "xxh3-128 (spec 2)": xxhash.xxh3_128_digest,
    }
    try:
        import blake3

        out["blake3"] = lambda data: blake3.blake3(data).digest(16)
    except ImportError:  # optional: pip install kvtier[bench]
        pass
    return out


def _chain(digest: Digest, root: bytes, data: bytes, step: int) -> list[bytes]:
    keys, prev = [], root
    view = memoryview(data)
    for off in range(0, len(data) - step + 1, step):
        prev = digest(prev + view[off : off + step])
        keys.append(prev)
    return keys


def run(tokens: int = 131072, chunk_tokens: int = 256, repeat: int = 20) -> dict:
    ns = Namespace(
        model="bench",
        dtype="bfloat16",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        chunk_tokens=chunk_tokens,
    )
    rng = np.random.default_rng(0)
    ids_np = rng.integers(0, 150_000, size=tokens, dtype=np.uint32)
    ids_list = [int(t) for t in ids_np]
    n_chunks = tokens // chunk_tokens
    rows: list[dict[str, Any]] = []
    containers: tuple[tuple[str, Any], ...] = (("list", ids_list), ("numpy", ids_np))
    for container, ids in containers:
        seconds = best_of(functools.partial(prompt_keys, ns, ids), repeat)
        rows.append({"what": f"prompt_keys (spec 3), tokens as {container}", "seconds": seconds})
    data = ids_np.astype("<u4").tobytes()
    root = ns.root_key()
    for name, digest in _digests().items():
        seconds = best_of(functools.partial(_chain, digest, root, data, chunk_tokens * 4), repeat)
        rows.append({"what": f"chain only: {name}", "seconds": seconds})
    for row in rows:
        row["keys_per_s"] = n_chunks / row["seconds"]
        row["tokens_per_s"] = tokens / row["seconds"]
    return {"tokens": tokens, "chunk_tokens": chunk_tokens, "chunks": n_chunks, "rows": rows}


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"chunk keys for a {report['tokens']:,}-token prompt "
        f"({report['chunks']} chunks of {report['chunk_tokens']})"
    )
    for col in ("what", "ms per prompt", "keys/s", "Mtokens/s"):
        table.add_column(col, justify="right")
    for row in report["rows"]:
        table.add_row(
            row["what"],
            f"{row['seconds'] * 1e3:.3f}",
            f"{row['keys_per_s']:,.0f}",
            f"{row['tokens_per_s'] / 1e6:.1f}",
        )
    console().print(table)
