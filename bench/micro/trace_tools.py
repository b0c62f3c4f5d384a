"""``kvtier bench trace-tools``: how fast the trace tools go, beside floors from the same run.

The trace is the shared Mooncake sample repeated ``copies`` times (hash ids shifted per copy,
so every copy is new to the caches; timestamps shifted after each other): three copies are
about the size of Mooncake's 12k-request conversation trace. Floors:

- *parse*: reading the file, the cost every tool pays before doing anything;
- *bare LRU*: the reference README's capacity replay with a plain ``OrderedDict`` and no
  policy object, the least a per-block cache simulation can cost in Python.

Timings are best of ``repeat``; figures are requests per second.
"""

from __future__ import annotations

import json
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.micro.timing import best_of
from kvtier.traces.analyze import analyze_file
from kvtier.traces.capacity import capacity_curve
from kvtier.traces.formats import TraceReader, read_trace
from kvtier.traces.simulate import ClusterSpec, simulate, simulate_file, sweep_specs


def synthesize(src: Path, dst: Path, copies: int) -> int:
    """``copies`` back-to-back copies of ``src`` with disjoint hash ids; returns requests."""
    lines = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    top = 1 + max((max(x["hash_ids"]) for x in lines if x["hash_ids"]), default=0)
    span = lines[-1]["timestamp"] - lines[0]["timestamp"] + 1
    with open(dst, "w") as f:
        for c in range(copies):
            for x in lines:
                y = dict(
                    x,
                    timestamp=x["timestamp"] + c * span,
                    hash_ids=[h + c * top for h in x["hash_ids"]],
                )
                f.write(json.dumps(y) + "\n")
    return copies * len(lines)


def _bare_lru(path: Path, capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for r in read_trace(path):
        ids = r.hash_ids
        total += len(ids)
        for h in ids:
            if h not in cache:
                break
            hits += 1
        for h in ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total


def run(src: Path, copies: int = 3, repeat: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        n = synthesize(src, path, copies)
        cap = 10_000
        base = ClusterSpec(instances=8, instances_per_node=4, gpu_blocks=1000, dram_blocks=8000)
        sweep = sweep_specs(base, gpu_blocks=[250, 500, 1000, 2000, 4000], dram_blocks=[0, 8000])
        cases: list[tuple[str, str, Callable[[], object]]] = [
            ("parse (floor)", "floor", lambda: sum(1 for _ in TraceReader(path))),
            ("bare OrderedDict LRU, 1 cache (floor)", "floor", lambda: _bare_lru(path, cap)),
            ("analyze", "tool", lambda: analyze_file(path)),
            (
                "capacity: BlockCache lru, 1 cache",
                "tool",
                lambda: capacity_curve(read_trace(path), [cap], ["lru"]),
            ),
            (
                "capacity: BlockCache s3fifo, 1 cache",
                "tool",
                lambda: capacity_curve(read_trace(path), [cap], ["s3fifo"]),
            ),
            (
                "simulate: 8 instances, round-robin",
                "tool",
                lambda: simulate(
                    read_trace(path),
                    [ClusterSpec(**{**base.__dict__, "routing": "round-robin"})],
                    derive_sessions=True,
                ),
            ),
            (
                "simulate: 8 instances, lmetric",
                "tool",
                lambda: simulate(read_trace(path), [base], derive_sessions=True),
            ),
            (
                "simulate: sweep of 10 specs, lmetric",
                "tool",
                lambda: simulate(read_trace(path), sweep, derive_sessions=True),
            ),
            (
                "simulate: the same sweep over 2 processes",
                "tool",
                lambda: simulate_file(path, sweep, jobs=2),
            ),
        ]
        rows = []
        for name, kind, fn in cases:
            seconds = best_of(fn, 1 if "sweep" in name else repeat)
            rows.append(
                {"case": name, "kind": kind, "seconds": seconds, "requests_per_s": n / seconds}
            )
    return {"requests": n, "copies": copies, "rows": rows}


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtier.traces.report import make_console

    parse = report["rows"][0]["seconds"]
    lru = report["rows"][1]["seconds"]
    t = Table(title=f"trace tools on {report['requests']:,} requests (best of runs)")
    t.add_column("case")
    t.add_column("seconds", justify="right")
    t.add_column("requests/s", justify="right")
    t.add_column("x parse", justify="right")
    t.add_column("x bare LRU", justify="right")
    for row in report["rows"]:
        t.add_row(
            row["case"],
            f"{row['seconds']:.2f}",
            f"{row['requests_per_s']:,.0f}",
            f"{row['seconds'] / parse:.1f}",
            f"{row['seconds'] / lru:.1f}",
        )
    make_console().print(t)
