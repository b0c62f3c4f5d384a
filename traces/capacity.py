"""``kvtier trace capacity``: prefix hit ratio of one cache, by size and eviction policy.

Each request looks up its leading blocks (stopping at the first miss) and then stores all its
blocks, through ``BlockCache`` (the store's semantics and policy classes). Every (policy,
capacity) cache is fed in the same single pass over the trace. With LRU this is the reference
README's capacity table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.traces.formats import DEFAULT_BLOCK_TOKENS, TraceRequest
from kvtier.traces.simcache import BlockCache


def capacity_curve(
    requests: Iterable[TraceRequest],
    capacities: Sequence[int],
    policies: Sequence[str] = ("lru", "s3fifo"),
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> dict[str, Any]:
    caches = [(p, c, BlockCache(c, p)) for p in policies for c in capacities]
    hits = [0] * len(caches)
    hit_tokens = [0] * len(caches)
    total_blocks = total_tokens = infinite_hits = 0
    seen: set[int] = set()
    for req in requests:
        ids = req.hash_ids
        total_blocks += len(ids)
        total_tokens += req.input_length
        for i, (_, _, cache) in enumerate(caches):
            n = cache.lookup(ids)
            cache.store(ids)
            hits[i] += n
            hit_tokens[i] += min(n * block_tokens, req.input_length)
        k = 0
        for h in ids:
            if h not in seen:
                break
            k += 1
        infinite_hits += k
        seen.update(ids)
    rows = [
        {
            "policy": policy,
            "capacity_blocks": cap,
            "capacity_tokens": cap * block_tokens,
            "hit_ratio": hits[i] / total_blocks if total_blocks else 0.0,
            "hit_ratio_tokens": hit_tokens[i] / total_tokens if total_tokens else 0.0,
            "evictions": cache.evictions,
        }
        for i, (policy, cap, cache) in enumerate(caches)
    ]
    return {
        "block_tokens": block_tokens,
        "total_blocks": total_blocks,
        "infinite_hit_ratio": infinite_hits / total_blocks if total_blocks else 0.0,
        "rows": rows,
    }


def plot_capacity(report: dict[str, Any], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = sorted({r["policy"] for r in report["rows"]})
    for policy in policies:
        rows = sorted(
            (r for r in report["rows"] if r["policy"] == policy), key=lambda r: r["capacity_blocks"]
        )
        ax.plot(
            [r["capacity_tokens"] / 1e6 for r in rows],
            [r["hit_ratio"] for r in rows],
            marker="o",
            label=policy,
        )
    ax.axhline(report["infinite_hit_ratio"], color="grey", ls="--", label="infinite cache")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sorted({r["capacity_tokens"] / 1e6 for r in report["rows"]}))
    ax.set_xlabel("cache capacity (M tokens)")
    ax.set_ylabel("prefix hit ratio (blocks)")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title or "single-cache prefix hit ratio by capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
