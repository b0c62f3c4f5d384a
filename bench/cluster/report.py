"""Tables (terminal and markdown) and the figure of ``kvtier bench cluster``'s report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

QS = ("p50", "p90", "p99")


def _s(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _pcts(stats: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    return " / ".join(_s(stats[q], scale, digits) for q in QS)


def main_rows(report: dict[str, Any]) -> list[list[str]]:
    head = [
        "configuration", "ok / sent", "errors / timeouts", "TTFT p50 / p90 / p99 s",
        "TPOT p50 / p90 / p99 ms", "E2E p50 / p90 / p99 s", "hit: GPU / DRAM / remote",
        "imbalance (computed tok)", "decision p50 / p99 ms",
    ]  # fmt: skip
    rows = [head]
    for r in report["configs"].values():
        t = r["tiers"]
        dec = r["router_decision"]
        log = dec.get("log") or {}
        rows.append(
            [
                r["label"],
                f"{r['ok']} / {r['requests']}",
                f"{r['errors']} / {r['timeouts']}",
                _pcts(r["ttft_s"]),
                _pcts(r["tpot_s"], 1e3, 1),
                _pcts(r["e2e_s"]),
                f"{t['ratio']['device']:.1%} / {t['dram_ratio']:.1%} / {t['ratio']['p2p']:.1%}",
                f"{r['imbalance']['computed_tokens']:.2f}",
                f"{_s(log.get('p50_ms'))} / {_s(log.get('p99_ms'))}"
                if log
                else f"{_s(dec['p50_s'], 1e3)} / {_s(dec['p99_s'], 1e3)}",
            ]
        )
    return rows


def class_rows(report: dict[str, Any]) -> list[list[str]]:
    classes = [c["name"] for c in report["trace"]["classes"]]
    head = ["configuration"] + [f"{c} n, TTFT p50 / p90 / p99 s" for c in classes]
    rows = [head]
    for r in report["configs"].values():
        row = [r["label"]]
        for c in classes:
            g = r["classes"].get(c)
            row.append(
                "-" if g is None or not g["requests"] else f"{g['requests']}: {_pcts(g['ttft_s'])}"
            )
        rows.append(row)
    return rows


def instance_rows(report: dict[str, Any]) -> list[list[str]]:
    names = sorted({n for r in report["configs"].values() for n in r["instances"]})
    head = ["configuration"] + [f"{n} req / hit" for n in names]
    rows = [head]
    for r in report["configs"].values():
        row = [r["label"]]
        for n in names:
            f = r["instances"].get(n)
            row.append("-" if f is None else f"{f['requests']:.0f} / {f['hit_ratio']:.0%}")
        rows.append(row)
    return rows


def split_rows(report: dict[str, Any]) -> list[list[str]]:
    """TTFT of hits and of long misses, and a long miss's ms per prompt token."""
    rows = [
        [
            "configuration",
            "hits n, TTFT p50 / p90 s",
            "long misses n, TTFT p50 / p90 s",
            "per miss token p50 / p90 ms",
        ]
    ]
    for r in report["configs"].values():
        split = r.get("hit_split")
        if split is None:  # a report written before the split was measured
            continue
        hits, misses = split["hits"], split["long_misses"]
        rows.append(
            [
                r["label"],
                f"{hits['requests']}: {_s(hits['ttft_s']['p50'])} / {_s(hits['ttft_s']['p90'])}",
                f"{misses['requests']}: {_s(misses['ttft_s']['p50'])} / "
                f"{_s(misses['ttft_s']['p90'])}",
                f"{_s(misses['ms_per_token']['p50'])} / {_s(misses['ms_per_token']['p90'])}",
            ]
        )
    return rows


CPU_ROLES = ("engines", "stores", "lmcache", "index", "router", "client")


def cpu_rows(report: dict[str, Any]) -> list[list[str]]:
    """Where the time went: cores each role kept busy during the replay (CPU seconds / replay
    seconds; on a small machine what runs beside the engines takes cores from them), engine
    steps and preemptions, and the ms per step the engines spent in kvtier's hooks."""
    configs = list(report["configs"].values())
    measured = {k for c in configs for k, v in (c.get("cpu_s") or {}).items() if v is not None}
    roles = [r for r in CPU_ROLES if r in measured]
    head = [
        "configuration", "replay s", *roles, "all", "load avg (start, end)", "engine steps",
        "preemptions", "kvtier hooks ms / step (scheduler / worker)",
    ]  # fmt: skip
    rows = [head]
    for r in configs:
        cpu = r.get("cpu_s") or {}
        wall = r["replay_s"] or 1.0
        used = [cpu.get(role) for role in roles]
        total = sum(u for u in used if u is not None)
        load = r.get("load_avg") or [None, None]
        eng = r.get("engines") or {}
        hooks = eng.get("hook_ms_per_step") or {}
        rows.append(
            [
                r["label"],
                f"{r['replay_s']:.0f}",
                *("-" if u is None else f"{u / wall:.2f}" for u in used),
                f"{total / wall:.2f}",
                f"{_s(load[0], digits=1)}, {_s(load[1], digits=1)}",
                f"{eng.get('steps', 0):.0f}",
                f"{eng.get('preemptions', 0):.0f}",
                f"{_s(hooks.get('scheduler'))} / {_s(hooks.get('worker'))}" if hooks else "-",
            ]
        )
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def trace_line(report: dict[str, Any]) -> str:
    t, topo = report["trace"], report["topology"]
    sc, sm = t["scale"], t["sampling"]
    pt = t["prompt_tokens"]
    bounds = ", ".join(
        c["name"] if c["below_sent_tokens"] is None else f"{c['name']} < {c['below_sent_tokens']}"
        for c in t["classes"]
    )
    kv = topo["kv_cache_bytes"]
    parts = [
        f"{t['requests']} requests in {t['sessions']} sessions sampled from "
        f"{Path(t['source']).name} (window {sm['window_seconds']} s from "
        f"{sm['window_start_seconds']:.0f} s, ratio {sm['sample_ratio']}, seed {sm['seed']});",
        f"lengths x{sc['length_scale']:g} ({sc['block_tokens']} tokens per "
        f"{sc['trace_block_tokens']}-token block), prompts capped at {sc['max_prompt_tokens']}",
        f"({t['capped_requests']} capped): mean {pt['mean']:.0f}, p90 {pt['p90']:.0f} tokens;",
        f"outputs capped at {sc['max_output_tokens']}; arrivals x{sc['time_scale']:g}:",
        f"{t['duration_s']:.0f} s, {t['arrival_rate_per_s']:.2f} req/s; infinite-cache hit",
        f"ratio {t['infinite_cache_hit_ratio']:.1%} ({t['cross_session_hit_share']:.0%} of it",
        f"cross-session). Classes by uncached tokens (sent): {bounds}.",
        f"{topo['nodes']} nodes x {topo['instances_per_node']} instances, {kv / 2**20:g} MiB of",
        f"KV per instance ({kv // report['kv_bytes_per_token']} tokens), {topo['pool']} DRAM",
        "per node.",
    ]
    return " ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    parts = [
        f"`{report['command']}`" if report.get("command") else "",
        trace_line(report),
        markdown_table(main_rows(report)),
        "TTFT by class:",
        markdown_table(class_rows(report)),
        *(
            [
                "Hits and misses: TTFT of the requests that hit any tier, and of the misses of"
                " 200 prompt tokens or more (queueing included), per prompt token too:",
                markdown_table(split),
            ]
            if len(split := split_rows(report)) > 1
            else []
        ),
        "Per instance (requests / prefix hit ratio):",
        markdown_table(instance_rows(report)),
        "Where the time went: cores busy during the replay by role (CPU seconds / replay"
        " seconds, each role with its child processes), engine steps and preemptions, and the"
        " ms per step the engines spent in kvtier's hooks:",
        markdown_table(cpu_rows(report)),
        *(f"**{name} failed**: {why}" for name, why in report.get("failed", {}).items()),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    out = console()
    out.print(trace_line(report))
    for title, rows in (
        ("cluster: one trace, every configuration", main_rows(report)),
        ("TTFT by class (uncached tokens)", class_rows(report)),
        ("per instance: requests / hit ratio", instance_rows(report)),
        ("where the time went: cores by role, steps, hook time", cpu_rows(report)),
    ):
        table = Table(title=title)
        for i, col in enumerate(rows[0]):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows[1:]:
            table.add_row(*row)
        out.print(table)
    for name, why in report.get("failed", {}).items():
        out.print(f"[red]{name} failed[/red]: {why}")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    configs = list(report["configs"].values())
    labels = [r["label"] for r in configs]
    x = np.arange(len(configs))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    for i, q in enumerate(QS):
        vals = [r["ttft_s"][q] or 0.0 for r in configs]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=f"TTFT {q}")
    ax.set_ylabel("seconds")
    ax.set_title("TTFT, all requests")
    ax.legend()
    ax = axes[0][1]
    classes = [c["name"] for c in report["trace"]["classes"]]
    width = 0.8 / max(len(classes), 1)
    for i, c in enumerate(classes):
        vals = [(r["classes"].get(c) or {}).get("ttft_s", {}).get("p90") or 0.0 for r in configs]
        ax.bar(x + (i - (len(classes) - 1) / 2) * width, vals, width, label=c)
    ax.set_ylabel("seconds")
    ax.set_title("TTFT p90 by class (uncached tokens)")
    ax.legend()
    ax = axes[1][0]
    bottom = np.zeros(len(configs))
    for key, name in (("device", "GPU"), ("dram", "DRAM"), ("p2p", "remote")):
        share = np.array(
            [
                r["tiers"]["dram_ratio"] if key == "dram" else r["tiers"]["ratio"][key]
                for r in configs
            ]
        )
        ax.bar(x, share, 0.6, bottom=bottom, label=name)
        bottom += share
    ax.axhline(report["trace"]["infinite_cache_hit_ratio"], color="k", ls="--", lw=1,
               label="infinite cache")  # fmt: skip
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("prefix hits by tier (vLLM's counters)")
    ax.legend()
    ax = axes[1][1]
    names = sorted({n for r in configs for n in r["instances"]})
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        vals = [(r["instances"].get(n) or {}).get("computed_tokens", 0.0) for r in configs]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, label=n)
    ax.set_ylabel("prompt tokens computed")
    ax.set_title("load per instance")
    ax.legend(fontsize=7)
    for row in axes:
        for a in row:
            a.set_xticks(x, labels, rotation=15, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
