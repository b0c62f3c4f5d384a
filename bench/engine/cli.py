"""The `kvtier bench` commands that run a real vLLM engine: tier latency, connector and decode
overhead, pool footprint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvtier.bench.options import JsonOut, write_report


def bench_tier_latency(
    lengths: Annotated[str, typer.Option(help="prefix lengths (tokens)")] = "2048,4096,8192",
    reps: Annotated[int, typer.Option(help="prompts per length")] = 5,
    configs: Annotated[
        str,
        typer.Option(
            help="kvtier, kvtier-disk (its disk tier), kvtier-remote, baseline (no connector), "
            "peers (lmcache, lmcache-disk: its L2 on the filesystem, vllm-offload)"
        ),
    ] = "kvtier,baseline",
    model: Annotated[str | None, typer.Option(help="model dir (default: a random preset)")] = None,
    preset: Annotated[str, typer.Option(help="random model preset")] = "cpu-bench",
    suffix: Annotated[
        int,
        typer.Option(
            help="new tokens after the reused prefix, as in an agent's next turn; every tier "
            "then computes the same tokens (0: resend unchanged, where vLLM and kvtier "
            "recompute the last block but LMCache only the last token)"
        ),
    ] = 32,
    out: Annotated[Path, typer.Option(help="folder for JSON and PNG")] = Path(
        "results/tier-latency"
    ),
    kappa_out: Annotated[
        Path | None,
        typer.Option(
            help="also write the measured kappa table (share of a recompute each tier saves, "
            "by length) here: router.kappa_file and connector.kappa_file read it"
        ),
    ] = None,
) -> None:
    """TTFT of miss / GPU hit / DRAM hit (and peers) by prefix length, tiers verified."""
    from kvtier.bench.engine import tier_latency, tier_latency_report

    report = tier_latency.run(
        [int(x) for x in lengths.split(",")],
        reps,
        [c.strip() for c in configs.split(",")],
        model=model,
        preset=preset,
        suffix=suffix,
        progress=typer.echo,
    )
    tier_latency_report.print_report(report)
    out.mkdir(parents=True, exist_ok=True)
    figures = tier_latency_report.to_json(report)
    (out / "tier-latency.json").write_text(json.dumps(figures, indent=2))
    tier_latency_report.plot(report, out / "tier-latency.png")
    typer.echo(f"wrote {out}/tier-latency.json and tier-latency.png")
    if kappa_out is not None:
        table = tier_latency_report.kappa_table(report)
        kappa_out.parent.mkdir(parents=True, exist_ok=True)
        kappa_out.write_text(
            json.dumps({t: {str(n): k for n, k in pts.items()} for t, pts in table.items()})
        )
        typer.echo(f"wrote {kappa_out}: kappa for {', '.join(table) or 'no tier'}")


def bench_connector_overhead(
    cached: Annotated[str, typer.Option(help="chunks held by the store")] = "0,1000,10000,100000",
    json_out: JsonOut = None,
) -> None:
    """Scheduler-side connector µs per engine step vs chunks held by the node store."""
    from kvtier.bench.engine import connector_overhead

    rows = connector_overhead.run([int(x) for x in cached.split(",")])
    connector_overhead.print_report(rows)
    write_report({"rows": rows}, json_out)


def bench_pool_footprint(
    model_family: Annotated[str, typer.Option(help="tiny model: llama, deepseek-mla, ...")] = (
        "deepseek-mla"
    ),
    tensor_parallel_sizes: Annotated[str, typer.Option(help="TP sizes to compare")] = "1,2",
    prompt_tokens: Annotated[int, typer.Option(help="tokens of the one prompt")] = 1024,
    json_out: JsonOut = None,
) -> None:
    """Pool bytes one saved prompt takes, per tensor-parallel size (MLA: stored once)."""
    from kvtier.bench.engine import pool_footprint

    sizes = [int(x) for x in tensor_parallel_sizes.split(",") if x.strip()]
    rows = pool_footprint.run(model_family, sizes, prompt_tokens)
    pool_footprint.print_report(rows)
    write_report({"rows": rows}, json_out)


def bench_decode_overhead(
    repeats: Annotated[int, typer.Option(help="rounds; each starts every configuration")] = 2,
    requests: Annotated[int, typer.Option(help="distinct prompts per server")] = 48,
    concurrency: Annotated[int, typer.Option(help="streams at a time")] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="tokens per prompt")] = 300,
    max_tokens: Annotated[int, typer.Option(help="tokens generated per request")] = 32,
    configs: Annotated[
        str,
        typer.Option(
            help="vllm (the floor), vllm-noop (a connector doing nothing), kvtier-embedded, "
            "kvtier-store, kvtier-store-grpc, kvtier-store-held, kvtier-store-asked"
        ),
    ] = "vllm,vllm-noop,kvtier-embedded,kvtier-store",
    preset: Annotated[
        str, typer.Option(help="random model preset (cpu-bench-swa: a sliding window)")
    ] = "cpu-bench",
    json_out: JsonOut = None,
) -> None:
    """TPOT and TTFT of one vLLM server with and without kvtier's connector, same workload."""
    from kvtier.bench.engine import decode_overhead

    chosen = tuple(c.strip() for c in configs.split(",") if c.strip())
    unknown = [c for c in chosen if c not in decode_overhead.CONFIGS]
    if not chosen or unknown:
        raise typer.BadParameter(f"configs: any of {', '.join(decode_overhead.CONFIGS)}")
    settings = decode_overhead.Settings(
        repeats, requests, concurrency, prompt_tokens, max_tokens, preset=preset
    )
    report = decode_overhead.run(settings, chosen)
    decode_overhead.print_report(report, settings)
    write_report(decode_overhead.to_json(report, settings), json_out)


def bench_tp_numerics(
    model_family: Annotated[str, typer.Option(help="tiny model: llama, gemma3-swa, ...")] = (
        "llama"
    ),
    dtypes: Annotated[str, typer.Option(help="model dtypes to compare in")] = "bfloat16,float32",
    lengths: Annotated[str, typer.Option(help="prompt lengths (tokens)")] = "300,600",
    json_out: JsonOut = None,
) -> None:
    """Whether TP 1 and TP 2 compute the same logprobs (and so the same KV): why instances of
    different TP sizes never share chunks."""
    import tempfile

    from kvtier.bench.engine import tp_numerics

    rows = tp_numerics.run(
        model_family,
        [d.strip() for d in dtypes.split(",") if d.strip()],
        [int(n) for n in lengths.split(",") if n.strip()],
        Path(tempfile.gettempdir()) / "kvtier-tp-numerics",
    )
    tp_numerics.print_report(rows)
    write_report({"rows": rows}, json_out)


def bench_session_turns(
    model_family: Annotated[str, typer.Option(help="tiny model: qwen3-next, llama, ...")] = (
        "qwen3-next"
    ),
    step_tokens: Annotated[int, typer.Option(help="vLLM's --max-num-batched-tokens")] = 1024,
    chunk_tokens: Annotated[int, typer.Option(help="kvtier's chunk (1: one KV block)")] = 1,
    first_tokens: Annotated[int, typer.Option(help="the first turn's prompt")] = 1500,
    turn_tokens: Annotated[int, typer.Option(help="tokens each turn adds")] = 800,
    turns: Annotated[int, typer.Option(help="turns of the session")] = 4,
    json_out: JsonOut = None,
) -> None:
    """A session's turns on another instance of the node: kvtier's DRAM hit per turn beside
    vLLM's own prefix cache on the instance that computed it, and exactness."""
    from kvtier.bench.engine import session_turns

    last = first_tokens + (turns - 1) * turn_tokens
    if turns < 2 or last + 8 > session_turns.MAX_MODEL_LEN:
        raise typer.BadParameter(
            f"at least 2 turns, the last ({last} tokens) within the tiny models' "
            f"{session_turns.MAX_MODEL_LEN} positions"
        )
    report = session_turns.run(
        model_family, step_tokens, chunk_tokens, first_tokens, turn_tokens, turns
    )
    session_turns.print_report(report)
    write_report(report, json_out)


def register(app: typer.Typer) -> None:
    """Add these commands to ``kvtier bench``."""
    app.command("tier-latency")(bench_tier_latency)
    app.command("connector-overhead")(bench_connector_overhead)
    app.command("pool-footprint")(bench_pool_footprint)
    app.command("decode-overhead")(bench_decode_overhead)
    app.command("tp-numerics")(bench_tp_numerics)
    app.command("session-turns")(bench_session_turns)
