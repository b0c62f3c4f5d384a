"""Rich tables and matplotlib plots for the trace commands' reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.traces.simulate import TIERS


def make_console() -> Any:

    from kvtier.core.logs import console

    # Piped output (files, CI logs) would be wrapped at 80 columns: tables here are wider.
    return console()


def print_analysis(r: dict[str, Any]) -> None:
    from rich.table import Table

    bt = r["block_tokens"]
    t = Table(title=f"trace {r['trace']['path']} ({r['trace']['format']}, {bt}-token blocks)")
    t.add_column("figure")
    t.add_column("value", justify="right")

    def dist(d: dict[str, float], keys: tuple[str, ...]) -> str:
        return " / ".join(f"{d[k]:,.1f}" if k == "mean" else f"{d[k]:,.0f}" for k in keys)

    inf = r["infinite_cache"]
    s = r["sessions"]
    rows = [
        ("requests", f"{r['requests']:,}"),
        ("duration", f"{r['duration_ms']:,.0f} ms"),
        (
            "input tokens mean / p50 / p90 / p99 / max",
            dist(r["input_tokens"], ("mean", "p50", "p90", "p99", "max")),
        ),
        (
            "output tokens mean / p50 / p90 / p99 / max",
            dist(r["output_tokens"], ("mean", "p50", "p90", "p99", "max")),
        ),
        ("prefill share of tokens", f"{r['prefill_token_share']:.1%}"),
        ("blocks / request (mean)", f"{r['blocks_per_request_mean']:.2f}"),
        ("unique blocks / total blocks", f"{r['blocks']['unique']:,} / {r['blocks']['total']:,}"),
        ("prefix hit ratio, infinite cache (blocks)", f"{inf['hit_ratio_blocks']:.4f}"),
        ("prefix hit ratio, infinite cache (tokens)", f"{inf['hit_ratio_tokens']:.4f}"),
        ("requests with at least one hit block", f"{inf['requests_with_hit']:.1%}"),
        ("sessions / single-turn share", f"{s['count']:,} / {s['single_turn_share']:.1%}"),
        ("turns per session mean / max", f"{s['turns_mean']:.2f} / {s['turns_max']}"),
        ("top-5 sessions' share of tokens", f"{s['top5_token_share']:.1%}"),
        (
            "hits intra- / cross-session",
            f"{s['intra_session_hit_share']:.1%} / {s['cross_session_hit_share']:.1%}",
        ),
    ]
    for name, value in rows:
        t.add_row(name, value)
    console = make_console()
    console.print(t)
    console.print(f"[dim]sessions: {s['rule']}[/dim]")
    rep = r["prefix_repetition"]
    counts = list(rep["rows"][0]["counts"]) if rep["rows"] else []
    p = Table(title="prefix repetition: distinct prefixes of >= L tokens recurring >= N times")
    p.add_column("L (tokens)", justify="right")
    for c in counts:
        p.add_column(f"N >= {c}", justify="right")
    for row in rep["rows"]:
        p.add_row(f"{row['min_tokens']:,}", *(f"{row['counts'][c]:,}" for c in counts))
    console.print(p)
    if rep["inconsistent_blocks"]:
        console.print(
            f"[yellow]{rep['inconsistent_blocks']} blocks appear under different prefixes: "
            "hash ids are not prefix hashes[/yellow]"
        )


def print_capacity(r: dict[str, Any]) -> None:
    from rich.table import Table

    policies = sorted({row["policy"] for row in r["rows"]})
    caps = sorted({row["capacity_blocks"] for row in r["rows"]})
    by = {(row["policy"], row["capacity_blocks"]): row for row in r["rows"]}
    t = Table(title="prefix hit ratio (blocks) of one cache, requests in file order")
    t.add_column("capacity (blocks)", justify="right")
    t.add_column("tokens", justify="right")
    for p in policies:
        t.add_column(p, justify="right")
    for cap in caps:
        t.add_row(
            f"{cap:,}",
            f"{cap * r['block_tokens'] / 1e6:.1f} M",
            *(f"{by[(p, cap)]['hit_ratio']:.4f}" for p in policies),
        )
    make_console().print(t)
    make_console().print(f"infinite cache: {r['infinite_hit_ratio']:.4f}")


def print_simulation(reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    title = "tiered simulation: share of prompt blocks served by each tier"
    fleets = {(r["spec"]["instances"], r["spec"]["instances_per_node"]) for r in reports}
    if len(fleets) == 1:
        ((instances, per_node),) = fleets
        nodes = -(-instances // per_node)
        title += f" ({instances:,} instances, {nodes:,} node{'s' if nodes > 1 else ''})"
    t = Table(title=title)
    for col in ("routing", "dram policy", "GPU blk/inst", "DRAM blk/node"):
        t.add_column(col, justify="right")
    for tier in TIERS:
        t.add_column(tier, justify="right")
    t.add_column("total hit", justify="right")
    t.add_column("req max/mean", justify="right")
    t.add_column("prefill max/mean", justify="right")  # computed (missed) tokens
    t.add_column("TTFT p50/p90 (model)", justify="right")
    for r in reports:
        spec = r["spec"]
        hr = r["hit_ratio_blocks"]
        offloaded = f" + offload ({r.get('offloads', 0):,})" if spec.get("offload") else ""
        t.add_row(
            spec["routing"] + offloaded,
            spec["dram_policy"],
            f"{spec['gpu_blocks']:,}",
            f"{spec['dram_blocks']:,}",
            *(f"{hr[tier]:.3f}" for tier in TIERS),
            f"{r['total_hit_ratio']:.3f}",
            f"{r['load']['requests_max_over_mean']:.2f}",
            f"{r['load']['miss_tokens_max_over_mean']:.2f}",
            f"{r['modelled_ttft_s']['p50']:.2f} / {r['modelled_ttft_s']['p90']:.2f}",
        )
    console = make_console()
    console.print(t)
    # Why each policy routed where it did (affinity gates, sticky overrides), once per policy.
    seen: set[str] = set()
    for r in reports:
        routing, decisions = r["spec"]["routing"], r.get("routing_decisions", {})
        if routing in seen or len(decisions) < 2:
            continue
        seen.add(routing)
        why = ", ".join(f"{reason} {n:,}" for reason, n in decisions.items())
        console.print(f"[dim]{routing} decisions: {why}[/dim]")


def plot_simulation(reports: list[dict[str, Any]], path: Path) -> None:
    """Hit ratio against the swept capacity; one line per other setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = [r["spec"] for r in reports]
    axes = ("gpu_blocks", "dram_blocks")
    x_axis = max(axes, key=lambda a: len({s[a] for s in specs}))
    other = [a for a in ("gpu_blocks", "dram_blocks", "routing", "dram_policy") if a != x_axis]
    lines: dict[tuple, list[dict[str, Any]]] = {}
    for r in reports:
        lines.setdefault(tuple(r["spec"][a] for a in other), []).append(r)
    bt = specs[0]["block_tokens"]
    fig, (ax_total, ax_gpu) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for key, rs in lines.items():
        rs.sort(key=lambda r: r["spec"][x_axis])
        xs = [r["spec"][x_axis] * bt / 1e6 for r in rs]
        label = ", ".join(
            f"{a.split('_')[0]} {v:,} blk" if isinstance(v, int) else str(v)
            for a, v in zip(other, key, strict=True)
        )
        ax_total.plot(xs, [r["total_hit_ratio"] for r in rs], marker="o", label=label)
        ax_gpu.plot(xs, [r["hit_ratio_blocks"]["gpu"] for r in rs], marker="o", label=label)
    unit = "per instance" if x_axis == "gpu_blocks" else "per node"
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax, what in ((ax_total, "GPU + DRAM + remote"), (ax_gpu, "GPU only")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted({r["spec"][x_axis] * bt / 1e6 for r in reports}))
        ax.set_xlabel(f"{x_axis.split('_')[0].upper()} capacity {unit} (M tokens)")
        ax.set_title(f"prefix hit ratio: {what}")
        ax.set_ylim(0, 1)
        ax.grid(True, which="both", alpha=0.3)
    ax_total.set_ylabel("share of prompt blocks")
    ax_gpu.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_sample(r: dict[str, Any]) -> None:
    from rich.table import Table

    figs = r["figures"]
    t = Table(title=f"sampling {r['input']} -> {r['output']}")
    t.add_column("figure")
    for col in figs:
        t.add_column(col, justify="right")
    for key in figs["trace"]:
        cells = []
        for col in figs:
            v = figs[col][key]
            cells.append(f"{v:,}" if isinstance(v, int) else f"{v:,.3f}")
        t.add_row(key, *cells)
    make_console().print(t)
    make_console().print(f"[dim]options: {r['options']}[/dim]")
