"""What ``kvtier bench tier-latency`` prints, plots and writes from a run's ``Report``
(``tier_latency.py`` measures): the TTFT table by tier, the ratios against the targets and
the memcpy floor, the disk tier's table, the kappa table routers and connectors read
(``router.kappa_file``, ``connector.kappa_file``), the plot and the JSON report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.bench.engine.tier_latency import Report


def summary_rows(report: Report) -> list[dict[str, Any]]:
    rows = []
    configs = sorted({s.config for s in report.samples})
    for length in report.lengths:
        for config in configs:
            for tier in ("miss", "gpu", "dram", "remote", "disk"):
                p50 = report.p(config, tier, length, 50)
                if p50 is None:
                    continue
                rows.append(
                    {
                        "length": length,
                        "config": config,
                        "tier": tier,
                        "p50_s": p50,
                        "p90_s": report.p(config, tier, length, 90),
                        "n": sum(
                            1
                            for s in report.samples
                            if s.config == config
                            and s.tier == tier
                            and s.length == length
                            and s.verified
                        ),
                    }
                )
    return rows


def print_report(report: Report) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    out = console()
    table = Table(
        title=f"TTFT by tier, p50 / p90 over {report.reps} prompts per length "
        f"({report.moved_bytes_per_token or report.kv_bytes_per_token} B of KV per token "
        f"{'moved by a DRAM hit' if report.moved_bytes_per_token else 'configured'}; "
        f"{report.suffix} new tokens after "
        "the reused prefix)"
    )
    for col in ("prefix", "config", "tier", "p50 s", "p90 s", "n"):
        table.add_column(col, justify="right")
    for row in summary_rows(report):
        table.add_row(
            f"{row['length']:,}",
            row["config"],
            row["tier"],
            f"{row['p50_s']:.3f}",
            f"{row['p90_s']:.3f}",
            str(row["n"]),
        )
    out.print(table)
    table = Table(
        title="ratios of p50s (targets: DRAM <= 1.5x GPU, miss >= 5x DRAM, remote "
        "<= 2x DRAM, kvtier DRAM <= LMCache's) and the memcpy floor"
    )
    for col in (
        "prefix",
        "KV MiB",
        "memcpy ms",
        "gpu ms",
        "dram ms",
        "dram/gpu",
        "miss/dram",
        "remote ms",
        "remote/dram",
        "lmcache dram ms",
        "kvtier/lmcache",
    ):
        table.add_column(col, justify="right")
    for length in report.lengths:
        dram = report.p("kvtier", "dram", length, 50)
        gpu = report.p("kvtier", "gpu", length, 50)
        miss = report.p("kvtier", "miss", length, 50)
        remote = report.p("kvtier-remote", "remote", length, 50)
        remote_dram = report.p("kvtier-remote", "dram", length, 50) or dram
        peer = report.p("lmcache", "dram", length, 50)
        table.add_row(
            f"{length:,}",
            f"{length * (report.moved_bytes_per_token or report.kv_bytes_per_token) / 2**20:.0f}",
            f"{report.floors[length] * 1e3:.1f}",
            _ms(gpu),
            _ms(dram),
            _ratio(dram, gpu),
            _ratio(miss, dram),
            _ms(remote),
            _ratio(remote, remote_dram),
            _ms(peer),
            _ratio(dram, peer),
        )
    out.print(table)
    if report.disk_floors:
        table = Table(
            title="kvtier-disk: a disk hit's TTFT beside a miss and a DRAM hit (p50), and the "
            "filesystem's floor for the same bytes (write fsynced, read with the page cache "
            "dropped; best of 3)"
        )
        for col in ("prefix", "miss ms", "dram ms", "disk ms", "disk/miss", "LMCache L2 ms",
                    "write ms", "read ms", "read GB/s"):  # fmt: skip
            table.add_column(col, justify="right")
        per_token = report.moved_bytes_per_token or report.kv_bytes_per_token
        for length in report.lengths:
            write, read = report.disk_floors.get(length, (0.0, 0.0))
            disk_hit = report.p("kvtier-disk", "disk", length, 50)
            miss = report.p("kvtier-disk", "miss", length, 50)
            table.add_row(
                f"{length:,}",
                _ms(miss),
                _ms(report.p("kvtier", "dram", length, 50)),
                _ms(disk_hit),
                _ratio(disk_hit, miss),
                _ms(report.p("lmcache-disk", "l2", length, 50)),
                f"{write * 1e3:.1f}",
                f"{read * 1e3:.1f}",
                f"{length * per_token / read / 1e9:.2f}" if read else "-",
            )
        out.print(table)
    for note in report.notes:
        out.print(note)
    for name, error in report.failures.items():
        out.print(f"[yellow]{name} does not run this model: {error}")
    for sample in report.rejected():
        out.print(
            f"[yellow]left out: {sample.config} {sample.tier} at {sample.length} "
            f"landed elsewhere: {sample.cached_by_source}"
        )


# where each tier's kappa is measured: (config, tier) of the hit, beside that config's miss and
# GPU hit (each run has its own; the remote run's node A misses nothing, so node B's kvtier run)
KAPPA_SOURCES = {
    "dram": ("kvtier", "dram", "kvtier"),
    "remote": ("kvtier-remote", "remote", "kvtier"),
    "disk": ("kvtier-disk", "disk", "kvtier-disk"),
}


def kappa_table(report: Report) -> dict[str, dict[int, float]]:
    """kappa per tier and length: the share of a recompute a hit in that tier saves,
    (miss - tier) / (miss - gpu) from p50s of this run (clamped to [0, 1]: a tier slower than
    recompute saves nothing). What ``router.kappa_file`` and ``connector.kappa_file`` read."""
    out: dict[str, dict[int, float]] = {}
    for name, (config, tier, base) in KAPPA_SOURCES.items():
        for length in report.lengths:
            hit = report.p(config, tier, length, 50)
            miss = report.p(base, "miss", length, 50)
            gpu = report.p(base, "gpu", length, 50)
            if hit is None or miss is None or gpu is None or miss <= gpu:
                continue
            out.setdefault(name, {})[length] = min(1.0, max(0.0, (miss - hit) / (miss - gpu)))
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in sorted({s.config for s in report.samples}):
        for tier in ("miss", "gpu", "dram", "remote", "disk"):
            points = [(L, report.p(config, tier, L, 50)) for L in report.lengths]
            points = [(L, v) for L, v in points if v is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=f"{config} {tier}")
    floors = [report.floors[L] for L in report.lengths]
    ax.plot(report.lengths, floors, linestyle=":", color="grey", label="memcpy of the KV")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("reused prefix (tokens)")
    ax.set_ylabel("time to first token, p50 (s)")
    ax.set_title("TTFT by tier (vLLM CPU build)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def to_json(report: Report) -> dict:
    return {
        "model": report.model,
        "lengths": report.lengths,
        "reps": report.reps,
        "kv_bytes_per_token": report.kv_bytes_per_token,
        "moved_bytes_per_token": report.moved_bytes_per_token,
        "suffix": report.suffix,
        "floors_s": {str(k): v for k, v in report.floors.items()},
        "disk_floors_s": {
            str(k): {"write": w, "read": r} for k, (w, r) in report.disk_floors.items()
        },
        "failures": report.failures,
        "summary": summary_rows(report),
        "samples": [s.__dict__ for s in report.samples],
    }
