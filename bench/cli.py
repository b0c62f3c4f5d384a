"""``kvtier bench ...``: benchmark commands. Each prints a table and can write JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter

from kvtier.bench.cluster.options import bench_cluster

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks against floors and peers.")

JsonOut = Annotated[Path | None, typer.Option("--json", help="also write the report here")]
_bytes = TypeAdapter(ByteSize)


def _sizes(value: str) -> list[int]:
    return [int(_bytes.validate_python(v.strip())) for v in value.split(",") if v.strip()]


def _write(report: dict, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        typer.echo(f"wrote {path}")


@bench_app.command("pool")
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
        _sizes(sizes),
        int(_bytes.validate_python(total)),
        int(_bytes.validate_python(batch_bytes)),
        repeat,
    )
    pool.print_report(report)
    _write(report, json_out)


@bench_app.command("control")
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
    _write(report, json_out)


@bench_app.command("keys")
def bench_keys(
    tokens: Annotated[int, typer.Option(help="prompt length")] = 131072,
    chunk_tokens: Annotated[int, typer.Option()] = 256,
    json_out: JsonOut = None,
) -> None:
    """Chunk keys per second for a long prompt (SHA-256, the spec, vs XXH3-128 vs BLAKE3)."""
    from kvtier.bench.micro import keys

    report = keys.run(tokens, chunk_tokens)
    keys.print_report(report)
    _write(report, json_out)


@bench_app.command("disk-io")
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
        int(_bytes.validate_python(chunk)),
        chunks,
        repeat,
        int(_bytes.validate_python(segment)),
    )
    typer.echo(disk_io.format_report(report))
    _write(asdict(report), json_out)


@bench_app.command("disk-writeback")
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
        [int(_bytes.validate_python(p)) for p in pools.split(",")],
        [float(r) for r in rates.split(",")],
        int(_bytes.validate_python(chunk)),
        seconds,
    )
    typer.echo(disk_writeback.format_report(report))
    if plot is not None:
        disk_writeback.plot([report], plot)
    _write(report, json_out)


@bench_app.command("kv-copy")
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

        report = kv_copy.run(
            counts[0], int(_bytes.validate_python(page)), layers or 4, repeat=repeat
        )
        kv_copy.print_report(report)
    else:
        raise typer.BadParameter("--device cpu takes one --tokens count; --device is cpu or cuda")
    _write(report, json_out)


@bench_app.command("remote")
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
        _sizes(sizes),
        batch,
        int(_bytes.validate_python(total)),
        repeat=repeat,
        mooncake_store=mooncake_store,
    )
    remote.print_report(report)
    _write(report, json_out)


@bench_app.command("tier-latency")
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
    from kvtier.bench.engine import tier_latency

    report = tier_latency.run(
        [int(x) for x in lengths.split(",")],
        reps,
        [c.strip() for c in configs.split(",")],
        model=model,
        preset=preset,
        suffix=suffix,
        progress=typer.echo,
    )
    tier_latency.print_report(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier-latency.json").write_text(json.dumps(tier_latency.to_json(report), indent=2))
    tier_latency.plot(report, out / "tier-latency.png")
    typer.echo(f"wrote {out}/tier-latency.json and tier-latency.png")
    if kappa_out is not None:
        table = tier_latency.kappa_table(report)
        kappa_out.parent.mkdir(parents=True, exist_ok=True)
        kappa_out.write_text(
            json.dumps({t: {str(n): k for n, k in pts.items()} for t, pts in table.items()})
        )
        typer.echo(f"wrote {kappa_out}: kappa for {', '.join(table) or 'no tier'}")


@bench_app.command("connector-overhead")
def bench_connector_overhead(
    cached: Annotated[str, typer.Option(help="chunks held by the store")] = "0,1000,10000,100000",
    json_out: JsonOut = None,
) -> None:
    """Scheduler-side connector µs per engine step vs chunks held by the node store."""
    from kvtier.bench.engine import connector_overhead

    rows = connector_overhead.run([int(x) for x in cached.split(",")])
    connector_overhead.print_report(rows)
    _write({"rows": rows}, json_out)


@bench_app.command("pool-footprint")
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
    _write({"rows": rows}, json_out)


@bench_app.command("decode-overhead")
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
            "kvtier-store, kvtier-store-grpc"
        ),
    ] = "vllm,vllm-noop,kvtier-embedded,kvtier-store",
    json_out: JsonOut = None,
) -> None:
    """TPOT and TTFT of one vLLM server with and without kvtier's connector, same workload."""
    from kvtier.bench.engine import decode_overhead

    chosen = tuple(c.strip() for c in configs.split(",") if c.strip())
    unknown = [c for c in chosen if c not in decode_overhead.CONFIGS]
    if not chosen or unknown:
        raise typer.BadParameter(f"configs: any of {', '.join(decode_overhead.CONFIGS)}")
    settings = decode_overhead.Settings(repeats, requests, concurrency, prompt_tokens, max_tokens)
    report = decode_overhead.run(settings, chosen)
    decode_overhead.print_report(report, settings)
    _write(decode_overhead.to_json(report, settings), json_out)


@bench_app.command("index")
def bench_index(
    backends: Annotated[
        str, typer.Option(help="memory,redis,redis-cluster")
    ] = "memory,redis,redis-cluster",
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
    json_out: JsonOut = None,
) -> None:
    """Index query latency and vLLM event ingest on each backend, beside their floors, and how
    many instances each configuration's ingest holds."""
    from kvtier.bench.micro import index

    known = ("memory", "redis", "redis-cluster")
    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen or any(b not in known for b in chosen):
        raise typer.BadParameter(f"backends: a comma-separated subset of {', '.join(known)}")
    urls = {"redis": redis_url, "redis-cluster": redis_cluster_url}
    report = index.run(
        chosen, entries, instances, tokens, queries, urls, ingest_prompts, redis_ingest_prompts
    )
    index.print_report(report)
    _write(report, json_out)


KNEE_WORKLOADS = {  # preset -> (user tokens, output tokens) per turn
    "tiny": (224, 32),
    "cpu-bench": (480, 32),
}


@bench_app.command("knee")
def bench_knee(
    preset: Annotated[str, typer.Option(help="random model preset: tiny | cpu-bench")] = "tiny",
    model: Annotated[
        Path | None, typer.Option(help="a model dir instead of the preset (Llama-like)")
    ] = None,
    sessions: Annotated[int, typer.Option(help="S: concurrent sessions")] = 4,
    turns: Annotated[int | None, typer.Option(help="T: turns per session (6; quick: 4)")] = None,
    user_tokens: Annotated[
        int | None, typer.Option(help="U: new user tokens per turn (tiny 224, cpu-bench 480)")
    ] = None,
    output_tokens: Annotated[
        int | None, typer.Option(help="O: output tokens per turn (32)")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="GPU KV capacities, multiples of S*W (0.25,0.5,0.75,1,1.5,2)"),
    ] = None,
    gpu_blocks: Annotated[
        str | None, typer.Option(help="GPU KV capacities in blocks (instead of --gpu)")
    ] = None,
    dram: Annotated[
        str | None,
        typer.Option(help="DRAM tiers: none (no connector), a multiple of S*W or a size (none,2)"),
    ] = None,
    chunk_tokens: Annotated[int, typer.Option(help="kvtier chunk (tokens)")] = 32,
    disk: Annotated[
        str | None,
        typer.Option(
            help="give every DRAM configuration the node's disk tier (docs/disk.md): "
            "write-back or write-through"
        ),
    ] = None,
    fraction: Annotated[float, typer.Option(help="knee: this share of the best hit ratio")] = 0.9,
    seed: Annotated[int, typer.Option()] = 0,
    quick: Annotated[
        bool, typer.Option(help="4 turns, GPU 0.5,1.5 x S*W, DRAM none,2: ~3 minutes")
    ] = False,
    out: Annotated[Path, typer.Option(help="folder for JSON, PNG, per-request results")] = Path(
        "results/knee"
    ),
    report_json: Annotated[
        Path | None,
        typer.Option("--report", help="print and plot a saved knee.json again (runs nothing)"),
    ] = None,
) -> None:
    """Hit ratio by tier and TTFT vs GPU KV capacity (and DRAM): the knee, beside S*W."""
    import tempfile

    from kvtier.bench.knee import report as knee_report
    from kvtier.bench.knee import run as knee
    from kvtier.bench.knee.workload import Workload
    from kvtier.core.errors import KvtierError
    from kvtier.testing.models import ModelInfo, make_model

    if report_json is not None:
        saved = knee.KneeReport.from_json(json.loads(report_json.read_text()))
        knee_report.print_report(saved)
        knee_report.plot(saved, report_json.with_suffix(".png"))
        typer.echo(f"wrote {report_json.with_suffix('.png')}")
        return
    if model is None and preset not in KNEE_WORKLOADS:
        raise typer.BadParameter(f"preset must be one of {sorted(KNEE_WORKLOADS)}")
    u, o = KNEE_WORKLOADS.get(preset, KNEE_WORKLOADS["tiny"])
    model_dir = model or make_model(Path(tempfile.gettempdir()) / f"kvtier-{preset}", preset)
    info = ModelInfo.read(model_dir)
    try:
        workload = Workload(
            sessions=sessions,
            turns=turns or (4 if quick else 6),
            user_tokens=user_tokens or u,
            output_tokens=output_tokens or o,
            vocab_size=info.vocab_size,
            seed=seed,
        )
        if workload.max_model_len > info.max_positions:
            raise typer.BadParameter(
                f"the last turn needs {workload.max_model_len} tokens; the model takes "
                f"{info.max_positions}: fewer turns or tokens"
            )
        if gpu_blocks:
            blocks = [int(b) for b in gpu_blocks.split(",") if b.strip()]
        else:
            spec = gpu or ("0.5,1.5" if quick else "0.25,0.5,0.75,1,1.5,2")
            blocks = knee.gpu_blocks_for([float(m) for m in spec.split(",")], workload)
        drams = [
            knee.dram_bytes_for(d, workload, info.kv_bytes_per_token)
            for d in (dram or "none,2").split(",")
        ]
        configs = knee.grid(blocks, drams)
        if disk not in (None, "write-back", "write-through"):
            raise typer.BadParameter(f"--disk {disk!r}: write-back or write-through")
        settings = knee.RunSettings(
            model_dir=Path(model_dir),
            info=info,
            out_dir=out,
            chunk_tokens=chunk_tokens,
            disk=disk,
        )
        knee.check_configs(configs, workload)
    except (KvtierError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(
        f"{len(configs)} configurations, a fresh vLLM server each (~30 s to start on 2 cores); "
        + knee_report.headline(knee.workload_json(workload, settings))
    )
    report = knee.run(workload, configs, settings, fraction, preset=None if model else preset)
    knee_report.print_report(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "knee.json").write_text(json.dumps(report.to_json(), indent=2))
    knee_report.plot(report, out / "knee.png")
    typer.echo(f"wrote {out}/knee.json and knee.png (per-request results: {out}/*.jsonl)")


@bench_app.command("faults")
def bench_faults(
    requests: Annotated[int, typer.Option(help="requests per drill and phase (>= 100)")] = 100,
    drills: Annotated[
        str | None, typer.Option(help="comma-separated drill names (default: all)")
    ] = None,
    out: Annotated[Path, typer.Option(help="folder for faults.json and faults.md")] = Path(
        "results/faults"
    ),
    model_family: Annotated[
        str, typer.Option(help="architecture of the tiny model: llama, gemma3-swa, ...")
    ] = "llama",
    tensor_parallel_size: Annotated[
        int, typer.Option(help="TP ranks per instance (2 runs on the CPU build)")
    ] = 1,
) -> None:
    """Every failure path through real vLLM instances and stores: wrong tokens, crashes."""
    from rich.table import Table
    from tqdm import tqdm

    from kvtier.bench.faults import run as faults
    from kvtier.bench.faults.drills import DRILLS
    from kvtier.core.logs import console

    names = [d.strip() for d in drills.split(",")] if drills else list(DRILLS)
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise typer.BadParameter(f"unknown drills {unknown}; choose from {sorted(DRILLS)}")
    bar = tqdm(total=len(names), unit="drill")

    started: list[str] = []

    def progress(name: str) -> None:  # called as each drill starts
        if started:
            bar.update(1)
        started.append(name)
        bar.set_description(name)

    from kvtier.testing.models import FAMILIES

    if model_family not in FAMILIES:
        raise typer.BadParameter(f"unknown model family; choose from {sorted(FAMILIES)}")
    engine = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    results = faults.run_drills(
        {n: DRILLS[n] for n in names},
        requests,
        progress=progress,
        family=model_family,
        engine_args=engine,
    )
    bar.update(len(started) - bar.n)
    bar.close()
    rows = faults.table(results)
    layout = f", TP {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    table = Table(title=f"fault drills, {model_family}{layout}, {requests} requests per phase")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows[1:]:
        table.add_row(*row)
    console().print(table)
    command = f"kvtier bench faults --requests {requests}" + (
        f" --drills {drills}" if drills else ""
    )
    faults.write(results, out, command)
    typer.echo(f"wrote {out}/faults.json and faults.md")
    bad = [r.drill for r in results if not r.ok]
    if bad:
        typer.echo(f"FAILED drills: {', '.join(bad)}", err=True)
        raise typer.Exit(1)


@bench_app.command("router")
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
    _write(report, json_out)


# kvtier bench cluster: its options are many, so the command lives in its own module
bench_app.command("cluster")(bench_cluster)


@bench_app.command("trace-tools")
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
    _write(report, json_out)
