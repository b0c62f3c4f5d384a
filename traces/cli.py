"""``kvtier trace ...``: analyse, sample, simulate and replay KV-cache workload traces."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtier.core.errors import KvtierError
from kvtier.router.policies import POLICIES
from kvtier.traces.formats import DEFAULT_BLOCK_TOKENS, TraceFormat

trace_app = typer.Typer(
    no_args_is_help=True,
    help="Trace tools: analyze, capacity, simulate, sample, replay, summarize, convert.",
)

TraceArg = Annotated[Path, typer.Argument(help="trace file (.jsonl or .jsonl.gz)")]
FormatOpt = Annotated[TraceFormat, typer.Option("--format", help="auto detects a session_id field")]
BlockOpt = Annotated[
    int, typer.Option("--trace-block-tokens", help="tokens per hash id in the trace")
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="also write the report as JSON")]
ProgressOpt = Annotated[bool, typer.Option(help="progress bar on stderr")]


def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated integers") from None


def _strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _write_json(report: Any, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        typer.echo(f"wrote {path}", err=True)


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(2)


def _reader_progress(path: Path, fmt: TraceFormat, block_tokens: int, progress: bool, desc: str):
    """A streaming reader wrapped in a byte-based progress bar."""
    from tqdm import tqdm

    from kvtier.traces.formats import TraceReader

    reader = TraceReader(path, fmt, block_tokens)

    def gen() -> Iterator[Any]:
        with tqdm(
            total=reader.total_bytes,
            unit="B",
            unit_scale=True,
            desc=desc,
            disable=None if progress else True,
            leave=False,
        ) as bar:
            last = 0
            for req in reader:
                yield req
                if reader.bytes_read - last > 1 << 18:
                    bar.update(reader.bytes_read - last)
                    last = reader.bytes_read

    return reader, gen()


@trace_app.command("analyze")
def analyze_cmd(
    trace: TraceArg,
    fmt: FormatOpt = TraceFormat.AUTO,
    block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
    progress: ProgressOpt = True,
    json_out: JsonOpt = None,
) -> None:
    """Lengths, block reuse, infinite-cache prefix hit ratio, sessions, prefix repetition."""
    from kvtier.traces.analyze import analyze_file
    from kvtier.traces.report import print_analysis

    try:
        report = analyze_file(trace, fmt, block_tokens, progress=progress)
    except KvtierError as e:
        raise _fail(e) from None
    print_analysis(report)
    _write_json(report, json_out)


@trace_app.command("capacity")
def capacity_cmd(
    trace: TraceArg,
    capacities: Annotated[str, typer.Option(help="cache sizes in blocks")] = (
        "1000,2000,5860,10000,20000,30000,50000,100000"
    ),
    policies: Annotated[str, typer.Option(help="eviction policies (kvtier's own classes)")] = (
        "lru,s3fifo"
    ),
    fmt: FormatOpt = TraceFormat.AUTO,
    block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
    plot: Annotated[Path | None, typer.Option(help="write a PNG capacity curve")] = None,
    progress: ProgressOpt = True,
    json_out: JsonOpt = None,
) -> None:
    """Prefix hit ratio of one cache by capacity and eviction policy (one pass for all)."""
    from kvtier.traces.capacity import capacity_curve, plot_capacity
    from kvtier.traces.report import print_capacity

    try:
        _, reqs = _reader_progress(trace, fmt, block_tokens, progress, "capacity")
        report = capacity_curve(reqs, _ints(capacities), _strs(policies), block_tokens)
    except (KvtierError, ValueError) as e:
        raise _fail(e) from None
    report["trace"] = str(trace)
    print_capacity(report)
    if plot is not None:
        plot_capacity(report, plot, title=f"{trace.name}: hit ratio by cache capacity")
        typer.echo(f"wrote {plot}", err=True)
    _write_json(report, json_out)


@trace_app.command("simulate")
def simulate_cmd(
    trace: TraceArg,
    instances: Annotated[int, typer.Option(help="vLLM instances")] = 4,
    instances_per_node: Annotated[int, typer.Option(help="instances sharing a DRAM pool")] = 2,
    gpu_blocks: Annotated[
        str, typer.Option(help="GPU cache per instance, blocks (list sweeps)")
    ] = ("2048"),
    dram_blocks: Annotated[str, typer.Option(help="DRAM pool per node, blocks (list sweeps)")] = (
        "8192"
    ),
    routing: Annotated[
        str,
        typer.Option(
            help=f"routing policy, kvtier.router.policies: {' | '.join(POLICIES)} (list sweeps)"
        ),
    ] = "lmetric",
    dram_policy: Annotated[str, typer.Option(help="lru | s3fifo (list sweeps)")] = "s3fifo",
    gpu_policy: Annotated[str, typer.Option(help="the GPU cache's policy (vLLM: lru)")] = "lru",
    dram_credit: Annotated[
        float,
        typer.Option(
            help="routing (cache-aware, lmetric, hybrid): weight of a DRAM-held token (GPU = 1)"
        ),
    ] = 0.5,
    remote: Annotated[bool, typer.Option(help="other nodes' pools as a remote tier")] = True,
    offload: Annotated[
        str,
        typer.Option(
            help="selective prefill offload, the router's gate: off | on | off,on (sweeps)"
        ),
    ] = "off",
    offload_min_tokens: Annotated[
        int, typer.Option(help="offload: only prompts whose uncached tokens reach this")
    ] = 8192,
    offload_max_concurrent: Annotated[
        int, typer.Option(help="offload: offloaded prefills in flight, cluster-wide")
    ] = 2,
    prefill_tokens_per_s: Annotated[float, typer.Option(help="time model: prefill rate")] = 10000.0,
    decode_ms_per_token: Annotated[float, typer.Option(help="time model: decode step")] = 20.0,
    fmt: FormatOpt = TraceFormat.AUTO,
    block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
    plot: Annotated[Path | None, typer.Option(help="write a PNG capacity curve")] = None,
    replicate: Annotated[
        int,
        typer.Option(
            help="K copies of the trace as distinct users (hash ids id*K+c, nothing shared), "
            "merged in time order: K x the arrival rate, to load K x the instances"
        ),
    ] = 1,
    replicate_spread_ms: Annotated[
        float,
        typer.Option(help="with --replicate: copy c arrives c x this / K ms after the original"),
    ] = 1000.0,
    time_scale: Annotated[
        float,
        typer.Option(help="timestamps x this before replicating (< 1 compresses: more load)"),
    ] = 1.0,
    jobs: Annotated[int, typer.Option(help="processes for a sweep (specs split)")] = 1,
    progress: ProgressOpt = True,
    json_out: JsonOpt = None,
) -> None:
    """Replay a trace through a model of kvtier's tiers: hit ratio per tier, capacity curves.

    Fleet scale: e.g. --instances 1000 --instances-per-node 8 --replicate 125 (one copy of the
    trace per 8-instance node) runs every routing policy in minutes."""
    import time

    from kvtier.traces.replicate import Replication
    from kvtier.traces.report import plot_simulation, print_simulation
    from kvtier.traces.simulate import ClusterSpec, simulate, simulate_file, sweep_specs

    started = time.perf_counter()
    try:
        replication = Replication(replicate, replicate_spread_ms, time_scale)
        base = ClusterSpec(
            instances=instances,
            instances_per_node=instances_per_node,
            gpu_policy=gpu_policy,
            dram_credit=dram_credit,
            remote=remote,
            block_tokens=block_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
            decode_ms_per_token=decode_ms_per_token,
            offload_min_tokens=offload_min_tokens,
            offload_max_concurrent=offload_max_concurrent,
        )
        switches = {"off": False, "on": True}
        offloads = [switches.get(o) for o in _strs(offload)]
        if None in offloads:
            raise ValueError(f"offload: off, on or off,on, not {offload!r}")
        routings = _strs(routing)
        unknown = [r for r in routings if r not in POLICIES]
        if unknown:
            raise ValueError(
                f"unknown routing policy {unknown[0]!r}; choose from {', '.join(POLICIES)}"
            )
        specs = sweep_specs(
            base,
            _ints(gpu_blocks),
            _ints(dram_blocks),
            routings,
            _strs(dram_policy),
            [o for o in offloads if o is not None],
        )
        if jobs > 1:
            reports = simulate_file(trace, specs, fmt, block_tokens, jobs, replication)
        else:
            reader, reqs = _reader_progress(trace, fmt, block_tokens, progress, "simulate")
            reports = simulate(
                replication.apply(reqs),
                specs,
                derive_sessions=reader.format is TraceFormat.MOONCAKE,
            )
    except (KvtierError, ValueError) as e:
        raise _fail(e) from None
    elapsed = time.perf_counter() - started
    print_simulation(reports)
    copies = "" if replication.identity else f" ({_replication_text(replication)})"
    requests = reports[0]["requests"] if reports else 0
    typer.echo(f"{requests:,} requests{copies} x {len(reports)} runs in {elapsed:,.1f} s")
    if plot is not None:
        plot_simulation(reports, plot)
        typer.echo(f"wrote {plot}", err=True)
    _write_json(
        {"trace": str(trace), "replication": replication.as_dict(), "runs": reports}, json_out
    )


def _replication_text(r: Any) -> str:
    parts = []
    if r.copies > 1:
        parts.append(f"{r.copies} copies over {r.spread_ms:g} ms")
    if r.time_scale != 1.0:
        parts.append(f"time x {r.time_scale:g}")
    return ", ".join(parts)


@trace_app.command("sample")
def sample_cmd(
    trace: TraceArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="sampled trace (session format)")],
    window_seconds: Annotated[float | None, typer.Option(help="window length; unset = all")] = None,
    window_start: Annotated[
        float | None, typer.Option(help="window start (s from the trace start); unset = random")
    ] = None,
    sample_ratio: Annotated[float, typer.Option(help="share of the window's sessions")] = 1.0,
    max_single_turn_ratio: Annotated[float, typer.Option(help="cap on single-turn sessions")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    fmt: FormatOpt = TraceFormat.AUTO,
    block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
    json_out: JsonOpt = None,
) -> None:
    """Window + thinning sample keeping whole sessions and cross-session sharing."""
    from kvtier.traces.report import print_sample
    from kvtier.traces.sample import SampleOptions, sample_file

    try:
        opts = SampleOptions(
            window_seconds, window_start, sample_ratio, max_single_turn_ratio, seed
        )
        report = sample_file(trace, out, opts, fmt, block_tokens)
    except KvtierError as e:
        raise _fail(e) from None
    print_sample(report)
    _write_json(report, json_out)


@trace_app.command("convert")
def convert_cmd(
    trace: TraceArg,
    out: Annotated[Path, typer.Option("--out", "-o")],
    to: Annotated[TraceFormat, typer.Option(help="session (sessions derived) | mooncake")] = (
        TraceFormat.SESSION
    ),
    fmt: FormatOpt = TraceFormat.AUTO,
    block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
) -> None:
    """Rewrite a trace in the other format (Mooncake -> session derives the sessions)."""
    from kvtier.traces.sample import SampleOptions, sample_file

    try:
        if to is TraceFormat.SESSION:
            report = sample_file(trace, out, SampleOptions(), fmt, block_tokens)
            typer.echo(f"wrote {report['written_requests']} requests to {out}")
            return
        from kvtier.traces.formats import TraceReader, TraceWriter

        with TraceWriter(out, to) as writer:
            for req in TraceReader(trace, fmt, block_tokens):
                writer.write(req)
        typer.echo(f"wrote {writer.count} requests to {out}")
    except KvtierError as e:
        raise _fail(e) from None


@trace_app.command("replay")
def replay_cmd(
    trace: TraceArg,
    url: Annotated[str, typer.Option(help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="model name the server serves")],
    out: Annotated[Path, typer.Option("--out", "-o", help="results JSONL (one line/request)")],
    block_tokens: Annotated[
        int, typer.Option(help="tokens sent per hash id (smaller scales the trace down)")
    ] = DEFAULT_BLOCK_TOKENS,
    vocab_size: Annotated[int, typer.Option(help="token ids stay below this")] = 32000,
    token_offset: Annotated[int, typer.Option(help="token ids start here (skip specials)")] = 16,
    seed: Annotated[int, typer.Option(help="token seed: same seed, same prompts")] = 0,
    max_output_tokens: Annotated[int | None, typer.Option(help="cap output_length")] = None,
    time_scale: Annotated[float, typer.Option(help="open loop: x trace times (0.5 = 2x)")] = 1.0,
    concurrency: Annotated[
        int | None, typer.Option(help="closed loop with N in flight (default: open loop)")
    ] = None,
    per_session: Annotated[
        bool,
        typer.Option(
            help="closed loop per session: a session's next turn as soon as its previous one "
            "finished, --concurrency sessions at a time (default: all)"
        ),
    ] = False,
    limit: Annotated[int | None, typer.Option(help="send only the first N requests")] = None,
    warmup: Annotated[int, typer.Option(help="first N requests excluded from the summary")] = 0,
    timeout: Annotated[float, typer.Option(help="per-request timeout, s")] = 600.0,
    classes: Annotated[str, typer.Option(help="classes by new (uncached) trace tokens")] = (
        "WARM:5000,MEDIUM:20000,HEAVY"
    ),
    ignore_eos: Annotated[bool, typer.Option(help="generate exactly max_tokens")] = True,
    resume: Annotated[bool, typer.Option(help="skip requests already in --out")] = False,
    metrics: Annotated[bool, typer.Option(help="scrape /metrics before and after")] = True,
    fmt: FormatOpt = TraceFormat.AUTO,
    trace_block_tokens: BlockOpt = DEFAULT_BLOCK_TOKENS,
    json_out: JsonOpt = None,
) -> None:
    """Send a trace to a server (streaming), time TTFT/TPOT/E2E, summarise per class."""
    from tqdm import tqdm

    from kvtier.traces.prompts import PromptSpec, parse_classes
    from kvtier.traces.replay import (
        ReplayOptions,
        ResultSink,
        TraceReplaySpec,
        iter_results,
        replay_trace,
    )
    from kvtier.traces.server_metrics import fetch_metrics, metrics_delta
    from kvtier.traces.summary import print_summary, summarize

    try:
        class_names = [c.name for c in parse_classes(classes)]
        sink = ResultSink(out, resume=resume)
        spec = TraceReplaySpec(
            prompt=PromptSpec(block_tokens, trace_block_tokens, vocab_size, token_offset, seed),
            max_output_tokens=max_output_tokens,
            limit=limit,
            warmup=warmup,
            time_scale=time_scale,
            classes=classes,
            skip=frozenset(sink.done),
        )
        opts = ReplayOptions(
            url=url,
            model=model,
            timeout_s=timeout,
            concurrency=concurrency,
            ignore_eos=ignore_eos,
            per_session=per_session,
        )
    except KvtierError as e:
        raise _fail(e) from None

    async def main() -> dict[str, float]:
        before = await fetch_metrics(url) if metrics else None
        with tqdm(total=limit, unit="req", desc="replay", disable=None, leave=False) as bar:
            await replay_trace(
                trace,
                opts,
                spec,
                sink,
                fmt,
                trace_block_tokens,
                on_result=lambda _: bar.update(),
                keep_results=False,
            )
        after = await fetch_metrics(url) if metrics else None
        return metrics_delta(before, after)

    try:
        delta = asyncio.run(main())
    except KvtierError as e:
        raise _fail(e) from None
    finally:
        sink.close()
    summary = summarize(iter_results(out), class_names)
    summary["server_metrics"] = delta
    summary["results"] = str(out)
    print_summary(summary, title=f"replay {trace.name} -> {url}")
    _write_json(summary, json_out)


@trace_app.command("summarize")
def summarize_cmd(
    results: Annotated[Path, typer.Argument(help="results JSONL written by replay")],
    classes: Annotated[str | None, typer.Option(help="class order, e.g. WARM,MEDIUM,HEAVY")] = None,
    json_out: JsonOpt = None,
) -> None:
    """Summarise a replay's results file again (p50/p90/p99, per class, errors)."""
    from kvtier.traces.replay import iter_results
    from kvtier.traces.summary import print_summary, summarize

    if not results.is_file():
        raise _fail(FileNotFoundError(f"{results} does not exist"))
    summary = summarize(iter_results(results), _strs(classes) if classes else None)
    print_summary(summary, title=f"replay results {results.name}")
    _write_json(summary, json_out)


if __name__ == "__main__":  # pragma: no cover
    trace_app(sys.argv[1:])
