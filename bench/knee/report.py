"""The capacity knee's table (rich) and plot (matplotlib PNG)."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.knee.results import ConfigResult, KneeReport, dram_label


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def headline(w: dict) -> str:
    """The workload in a line (``knee.workload_json``)."""
    bt = w["block_tokens"]
    sw = w["total_working_set_tokens"]
    return (
        f"{w['sessions']} sessions x {w['turns']} turns (U={w['user_tokens']}, "
        f"O={w['output_tokens']} tokens), W = {w['working_set_tokens']:,} tokens per session, "
        f"S*W = {sw:,} tokens = {sw // bt:,} blocks = "
        f"{w['total_working_set_bytes'] / 2**20:.1f} MiB of KV; "
        f"ideal hit {w['ideal_hit_ratio']:.1%}"
    )


def print_report(report: KneeReport) -> None:
    from rich.table import Table

    from kvtier.traces.report import make_console

    console = make_console()
    table = Table(title=f"capacity knee: {headline(report.workload)}")
    for col in (
        "DRAM",
        "GPU blocks",
        "GPU tokens",
        "x S*W",
        "hit device",
        "hit host",
        "hit disk",
        "hit total",
        "TTFT p50 s",
        "TTFT p90 s",
        "preempt",
        "errors",
    ):
        table.add_column(col, justify="right")
    for dram, line in report.lines().items():
        for r in line:
            table.add_row(
                dram_label(dram),
                f"{r.gpu_blocks:,}",
                f"{r.gpu_tokens:,}",
                f"{r.gpu_multiple:.2f}",
                _pct(r.hit["device"]),
                _pct(r.hit["host"]),
                _pct(r.hit.get("disk", 0.0)),
                _pct(r.hit["total"]),
                _s(r.ttft_p50_s),
                _s(r.ttft_p90_s),
                f"{r.preemptions:.0f}",
                str(r.errors),
            )
        table.add_section()
    console.print(table)
    for text in knee_lines(report):
        console.print(text)
    for r in report.results:
        for warning in warnings(r):
            console.print(f"[yellow]{r.gpu_blocks} blocks, DRAM {r.dram_label}: {warning}")


def knee_lines(report: KneeReport) -> list[str]:
    out = []
    for k in report.knees():
        what = "hit ratio" if k["tier"] == "total" else "GPU (device) hit ratio"
        where = (
            f"{k['gpu_blocks']:,} blocks = {k['gpu_tokens']:,} tokens "
            f"= {k['gpu_multiple']:.2f} x S*W"
        )
        note = " (the smallest capacity measured: the knee is there or below)"
        out.append(
            f"knee, DRAM {k['dram']}, {what}: {where}"
            f"{note if k['at_or_below_smallest'] else ''}; reaches {k['threshold']:.1%} "
            f"= {report.fraction:.0%} of the best {k['best_hit']:.1%}"
        )
    return out


def warnings(r: ConfigResult) -> list[str]:
    out = []
    if r.errors:
        out.append(f"{r.errors} of {r.requests} requests failed (see {r.results})")
    if r.queried_tokens != r.client_prompt_tokens:
        out.append(
            f"the server counted {r.queried_tokens:.0f} queried prompt tokens, the client sent "
            f"{r.client_prompt_tokens}: hit ratios are over the server's count"
        )
    if r.kvtier.get("save_no_space"):
        out.append(f"{r.kvtier['save_no_space']:.0f} DRAM saves refused for lack of space")
    return out


def plot(report: KneeReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = report.workload
    sw = w["total_working_set_tokens"]
    preset = report.model["preset"]
    model = f"{preset} random model" if preset else Path(report.model["path"]).name
    fig, (hit_ax, ttft_ax) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    knees = {(k["dram_bytes"], k["tier"]): k for k in report.knees()}
    for i, (dram, line) in enumerate(report.lines().items()):
        color = colors[i % len(colors)]
        xs = [r.gpu_multiple for r in line]
        label = f"DRAM {dram_label(dram)}"
        tiers = ("total",) if dram is None else ("total", "device")
        for tier in tiers:
            ys = [100 * r.hit[tier] for r in line]
            style = "-" if tier == "total" else "--"
            name = label if tier == "total" else f"{label}: GPU (device) hits only"
            hit_ax.plot(xs, ys, style, marker="o", color=color, label=name)
            knee = knees.get((dram, tier))
            if knee is not None:
                y = next(100 * r.hit[tier] for r in line if r.gpu_blocks == knee["gpu_blocks"])
                hit_ax.plot(knee["gpu_multiple"], y, "*", color=color, markersize=18, zorder=5)
                at_most = "<= " if knee["at_or_below_smallest"] else ""
                hit_ax.annotate(
                    f"knee {at_most}{knee['gpu_multiple']:.2f}x",
                    (knee["gpu_multiple"], y),
                    textcoords="offset points",
                    xytext=(8, -14 if tier == "device" else 6),
                    color=color,
                    fontsize=9,
                )
        ttft_ax.plot(
            xs, [r.ttft_p50_s for r in line], "-", marker="o", color=color, label=f"{label} p50"
        )
        ttft_ax.plot(
            xs, [r.ttft_p90_s for r in line], ":", marker="^", color=color, label=f"{label} p90"
        )
    hit_ax.axhline(100 * w["ideal_hit_ratio"], color="grey", linestyle=":", label="infinite cache")
    for ax in (hit_ax, ttft_ax):
        ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8, alpha=0.6)
        ax.grid(True, alpha=0.3)
    hit_ax.text(1.0, 2, " S*W", fontsize=9)
    hit_ax.set_ylabel("realised prefix hit ratio (%)")
    hit_ax.set_ylim(0, 100)
    hit_ax.legend(fontsize=8, loc="lower right")
    hit_ax.set_title(
        f"Capacity knee: {w['sessions']} sessions x {w['turns']} turns, "
        f"S*W = {sw:,} tokens\n(vLLM {report.machine['vllm']} {report.machine['vllm_build']} "
        f"build, {model}; star: knee, {report.fraction:.0%} "
        "of the line's best)",
        fontsize=10,
    )
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("time to first token (s)")
    ttft_ax.legend(fontsize=8, loc="upper right")
    ttft_ax.set_xlabel("GPU KV capacity (x S*W: concurrent sessions x per-session working set)")
    top = hit_ax.secondary_xaxis("top", functions=(lambda m: m * sw, lambda t: t / sw))
    top.set_xlabel("GPU KV capacity (tokens)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
