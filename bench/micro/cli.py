"""The `kvtier bench` micro-benchmarks: one component beside its floor (pool, control path,
keys, disk, copies, remote, index, router, trace tools)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvtier.bench.options import JsonOut, byte_size, parse_sizes, write_report


def bench_pool(
    mode: Annotated[str, typer.Option(help="process (a real store over gRPC) | embedded")] = (
        "process"
    ),
    sizes: Annotated[str, typer.Option(help="chunk sizes")] = "64KiB,256KiB,1MiB,4MiB,16MiB",
    total: Annotated[str, typer.Option(help="bytes moved per round")] = "256MiB",
    batch_bytes: Annotated[str, typer.Option(help="bytes per control call")] = "64MiB",
    repeat: Annotated[int, typer.Option(help="rounds; the best is kept")] = 3,
    json_out: JsonOut = None,
) -> None:
    """DRAM pool put/get throughput beside memcpy, and the control API's per-chunk cost."""
    from kvtier.bench.micro import pool

    if mode not in ("process", "embedded"):
        raise typer.BadParameter("mode must be process or embedded")
    report = pool.run(
        mode,
        parse_sizes(sizes),
        int(byte_size(total)),
        int(byte_size(batch_bytes)),
        repeat,
    )
    pool.print_report(report)
    write_report(report, json_out)


def bench_control(
    calls: Annotated[int, typer.Option(help="calls per path and repeat")] = 2000,
    hit_chunks: Annotated[int, typer.Option(help="chunks a leased hit covers")] = 8,
    repeats: Annotated[int, typer.Option(help="rounds, each timing every path")] = 3,
    json_out: JsonOut = None,
) -> None:
    """One engine-to-store control call by path (view, control socket, gRPC) beside a raw
    Unix-socket ping-pong floor measured in the same run."""
    from kvtier.bench.micro import control

    report = control.run(calls, hit_chunks, repeats)
    control.print_report(report)
    write_report(report, json_out)


def bench_keys(
    tokens: Annotated[int, typer.Option(help="prompt length")] = 131072,
    chunk_tokens: Annotated[int, typer.Option()] = 256,
    json_out: JsonOut = None,
) -> None:
    """Chunk keys per second for a long prompt (SHA-256, the spec, vs XXH3-128 vs BLAKE3)."""
    from kvtier.bench.micro import keys

    report = keys.run(tokens, chunk_tokens)
    keys.print_report(report)
    write_report(report, json_out)


def bench_disk_io(
    directory: Annotated[
        Path, typer.Option("--dir", help="where to write (the disk tier's filesystem)")
    ] = Path("results/disk-io"),
    chunk: Annotated[str, typer.Option(help="bytes per chunk file (a multiple of 4 KiB)")] = "8MiB",
    chunks: Annotated[int, typer.Option(help="files per round")] = 32,
    repeat: Annotated[int, typer.Option(help="rounds, the paths interleaved")] = 3,
    segment: Annotated[
        str, typer.Option(help="bytes per segment file of the segments path")
    ] = "64MiB",
    json_out: JsonOut = None,
) -> None:
    """The disk tier's chunk-file writes and reads beside O_DIRECT, segment files and the
    filesystem's sequential floor, on the same bytes (docs/disk.md)."""
    from dataclasses import asdict

    from kvtier.bench.micro import disk_io

    report = disk_io.run(
        directory,
        int(byte_size(chunk)),
        chunks,
        repeat,
        int(byte_size(segment)),
    )
    typer.echo(disk_io.format_report(report))
    write_report(asdict(report), json_out)


def bench_disk_writeback(
    directory: Annotated[
        Path, typer.Option("--dir", help="the disk tier's directory (its filesystem measured)")
    ] = Path("results/disk-writeback"),
    pools: Annotated[str, typer.Option(help="DRAM pool sizes")] = "512MiB,2GiB",
    rates: Annotated[
        str, typer.Option(help="rates of new KV, as multiples of the disk's write floor")
    ] = "0.25,0.5,1,2",
    chunk: Annotated[str, typer.Option(help="bytes per chunk")] = "2MiB",
    seconds: Annotated[float, typer.Option(help="measured seconds per run")] = 8.0,
    plot: Annotated[Path | None, typer.Option(help="also draw the shares (PNG)")] = None,
    json_out: JsonOut = None,
) -> None:
    """What share of evicted chunks the disk tier had copied, write-back against
    write-through, as new KV arrives at multiples of the disk's bandwidth (docs/disk.md)."""
    from kvtier.bench.micro import disk_writeback

    report = disk_writeback.run(
        directory,
        [int(byte_size(p)) for p in pools.split(",")],
        [float(r) for r in rates.split(",")],
        int(byte_size(chunk)),
        seconds,
    )
    typer.echo(disk_writeback.format_report(report))
    if plot is not None:
        disk_writeback.plot([report], plot)
    write_report(report, json_out)


def bench_kv_copy(
    tokens: Annotated[
        str, typer.Option(help="tokens loaded (a DRAM hit's size); several with --device cuda")
    ] = "8192",
    device: Annotated[str, typer.Option(help="cpu, or cuda (a GPU: vLLM's CUDA layouts)")] = "cpu",
    page: Annotated[str, typer.Option(help="cpu: bytes of one layer of one KV block")] = "64KiB",
    layers: Annotated[int, typer.Option(help="cpu default 4; cuda default 32")] = 0,
    kv_heads: Annotated[int, typer.Option(help="cuda: KV heads per layer")] = 8,
    head_size: Annotated[int, typer.Option(help="cuda")] = 128,
    case: Annotated[
        str, typer.Option(help="cuda: the KV layout (kvtier.bench.micro.kv_layouts)")
    ] = ("flash-attn"),
    new_tokens: Annotated[
        int, typer.Option(help="cuda: tokens of the forward a layer-wise load hides under")
    ] = 512,
    chunk_tokens: Annotated[
        int, typer.Option(help="tokens per chunk (connector.chunk_tokens)")
    ] = 256,
    repeat: Annotated[int, typer.Option(help="runs per row; the best is kept")] = 5,
    json_out: JsonOut = None,
    plot: Annotated[Path | None, typer.Option(help="cuda: also draw the fractions (PNG)")] = None,
) -> None:
    """The worker's pool <-> paged-KV copy beside its floor: memcpy and torch's index_copy_
    (CPU), pinned cudaMemcpy and a layer-wise load under a forward (CUDA)."""
    counts = [int(t) for t in tokens.split(",") if t.strip()]
    if device == "cuda":
        import torch

        from kvtier.bench.micro import kv_copy_cuda

        if not torch.cuda.is_available():
            typer.echo("no CUDA device here: --device cuda measures a GPU's copies", err=True)
            raise typer.Exit(2)

        report = kv_copy_cuda.run_cuda(
            counts,
            layers or 32,
            kv_heads,
            head_size,
            case,
            chunk_tokens=chunk_tokens,
            new_tokens=new_tokens,
            repeat=repeat,
        )
        kv_copy_cuda.print_report(report)
        if plot is not None:
            kv_copy_cuda.plot([report], plot)
    elif device == "cpu" and len(counts) == 1:
        from kvtier.bench.micro import kv_copy

        report = kv_copy.run(counts[0], int(byte_size(page)), layers or 4, repeat=repeat)
        kv_copy.print_report(report)
    else:
        raise typer.BadParameter("--device cpu takes one --tokens count; --device is cpu or cuda")
    write_report(report, json_out)


def bench_remote(
    sizes: Annotated[str, typer.Option(help="chunk sizes")] = "64KiB,256KiB,1MiB,4MiB,16MiB",
    batch: Annotated[int, typer.Option(help="chunks per batched call (one request's run)")] = 16,
    total: Annotated[str, typer.Option(help="bytes per measurement (caps iterations)")] = (
        "128MiB"
    ),
    repeat: Annotated[int, typer.Option(help="interleaved rounds; each system's best")] = 3,
    mooncake_store: Annotated[
        bool, typer.Option("--mooncake-store/--no-mooncake-store", help="also run the peer")
    ] = True,
    json_out: JsonOut = None,
) -> None:
    """Remote get latency/throughput: kvtier Fetch vs the raw transfer engine vs Mooncake Store."""
    from kvtier.bench.micro import remote

    report = remote.run(
        parse_sizes(sizes),
        batch,
        int(byte_size(total)),
        repeat=repeat,
        mooncake_store=mooncake_store,
    )
    remote.print_report(report)
    write_report(report, json_out)


def bench_index(
    backends: Annotated[
        str,
        typer.Option(
            help="memory,redis,redis-cluster,redis-cluster-chunk (the cluster with "
            "index.redis_placement = chunk)"
        ),
    ] = "memory,redis,redis-cluster,redis-cluster-chunk",
    entries: Annotated[int, typer.Option(help="chunk entries in the index")] = 1_000_000,
    instances: Annotated[int, typer.Option(help="vLLM instances holding them")] = 64,
    tokens: Annotated[int, typer.Option(help="prompt length asked about")] = 131072,
    queries: Annotated[int, typer.Option(help="timed queries (Redis: a quarter)")] = 2000,
    redis_url: Annotated[
        str | None, typer.Option(help="a Redis to use (default: start one on a free port)")
    ] = None,
    redis_cluster_url: Annotated[
        str | None,
        typer.Option(help="a node of a Redis Cluster to use (default: start 3 masters + replicas)"),
    ] = None,
    ingest_prompts: Annotated[int, typer.Option(help="8k-token prompts to ingest")] = 200,
    redis_ingest_prompts: Annotated[
        int, typer.Option(help="8k-token prompts to ingest into Redis (enough to time its CPU)")
    ] = 1000,
    cluster_shards: Annotated[
        int, typer.Option(help="shards the cluster index is cut into (index.redis_shards)")
    ] = 6,
    json_out: JsonOut = None,
) -> None:
    """Index query latency and vLLM event ingest on each backend, beside their floors, and how
    many instances each configuration's ingest holds."""
    from kvtier.bench.micro import index

    known = ("memory", "redis", "redis-cluster", "redis-cluster-chunk")
    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen or any(b not in known for b in chosen):
        raise typer.BadParameter(f"backends: a comma-separated subset of {', '.join(known)}")
    urls = {
        "redis": redis_url,
        "redis-cluster": redis_cluster_url,
        "redis-cluster-chunk": redis_cluster_url,
    }
    report = index.run(
        chosen,
        entries,
        instances,
        tokens,
        queries,
        urls,
        ingest_prompts,
        redis_ingest_prompts,
        cluster_shards=cluster_shards,
    )
    index.print_report(report)
    write_report(report, json_out)


def bench_router(
    backends: Annotated[int, typer.Option(help="instances the router chooses among")] = 16,
    max_tokens: Annotated[int, typer.Option(help="longest prompt of a session")] = 32768,
    turn_tokens: Annotated[int, typer.Option(help="tokens a turn adds")] = 1024,
    sessions: Annotated[int, typer.Option(help="sessions run one after another")] = 8,
    policy: Annotated[str, typer.Option(help="routing policy")] = "kvtier",
    json_out: JsonOut = None,
) -> None:
    """What one routing decision costs (tokenize + keys + index query + score) at long
    prompts, beside tokenizing from scratch and a bare index round trip."""
    from kvtier.bench.micro import router

    report = router.run(backends, max_tokens, turn_tokens, sessions, policy)
    router.print_report(report)
    write_report(report, json_out)


def trace_tools_cmd(
    trace: Annotated[Path, typer.Argument(help="a Mooncake trace to repeat")] = Path(
        "/work/shared/data/traces/mooncake_synthetic_trace.jsonl"
    ),
    copies: Annotated[int, typer.Option(help="copies of the trace, back to back")] = 3,
    repeat: Annotated[int, typer.Option(help="runs per case; the best is kept")] = 3,
    json_out: JsonOut = None,
) -> None:
    """Speed of analyze / capacity / simulate beside the parse and bare-LRU floors."""
    from kvtier.bench.micro import trace_tools as speed

    report = speed.run(trace, copies, repeat)
    speed.print_report(report)
    write_report(report, json_out)


def bench_router_scrape(
    instances: Annotated[int, typer.Option(help="stand-in instances the router scrapes")] = 16,
    seconds: Annotated[float, typer.Option(help="seconds of requests per run")] = 15.0,
    repeats: Annotated[int, typer.Option(help="runs of each configuration, interleaved")] = 3,
    json_out: JsonOut = None,
) -> None:
    """Request latency through a real router while it scrapes its instances' /metrics every
    second, beside the same router scraping once (the floor), on fresh processes."""
    from kvtier.bench.micro import router_scrape

    report = router_scrape.run(instances, seconds, repeats)
    router_scrape.print_report(report)
    write_report(report, json_out)


def register(app: typer.Typer) -> None:
    """Add these commands to ``kvtier bench``."""
    app.command("pool")(bench_pool)
    app.command("control")(bench_control)
    app.command("keys")(bench_keys)
    app.command("disk-io")(bench_disk_io)
    app.command("disk-writeback")(bench_disk_writeback)
    app.command("kv-copy")(bench_kv_copy)
    app.command("remote")(bench_remote)
    app.command("index")(bench_index)
    app.command("router")(bench_router)
    app.command("router-scrape")(bench_router_scrape)
    app.command("trace-tools")(trace_tools_cmd)
