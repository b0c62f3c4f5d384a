"""Index benchmarks: query latency against a large index, and vLLM event ingest rate.

    kvtier bench index [--backends memory,redis,redis-cluster] [--entries 1000000]
                       [--instances 64] [--tokens 131072] [--redis-url URL]
                       [--redis-cluster-url URL]

Query. The index holds ``entries`` chunk entries over ``instances`` vLLM instances (and two
node stores); the asked prompt (128k tokens = 512 chunks of 256) is held by 8 instances to
depths from 64 to 512 chunks, by 4 of them in CPU memory too, and by both stores. Figures:
p50/p99 of one ``query`` by chunk keys, by token ids (keying included) and for a prompt nobody
holds. Floors measured in the same run: keying the prompt (what a token query adds); for the
memory backend a bare dict lookup of the 512 keys; for Redis a PING round trip and an MGET of
the 512 keys (the least any Redis index must do per query).

Ingest. vLLM ``BlockStored`` batches as an engine publishes them (msgpack, 16-token blocks,
256-token chunks, 8k-token prompts in 2k-token steps, half of them extending an earlier prompt
at an arbitrary token, i.e. forking inside a chunk), through decode + block mapping + the
in-memory backend on one thread. Figure: blocks/s, beside the floor of only decoding the
payloads; with the collector tuned as ``kvtier index serve`` tunes it, and with defaults.
Redis is started on a free port when no ``--redis-url`` is given (needs ``redis-server``),
a 3-master cluster when no ``--redis-cluster-url`` is. On Redis and the cluster: ingest, and
the instances each configuration's ingest holds (``index_redis``).
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, chunk_keys
from kvtier.index.api import ChunkIndex, ChunkOp, LocationKind, Query, Registration
from kvtier.index.backends.memory import MemoryIndex
from kvtier.index.ingest.vllm_blocks import BlockMapper
from kvtier.index.ingest.vllm_wire import BlockStored, EventBatchDecoder, encode_batch
from kvtier.index.server.feed import ChangeFeed, FeedingIndex
from kvtier.store.api.events import EventKind
from kvtier.testing.ports import free_port

NS = Namespace(
    model="bench", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_size=128, chunk_tokens=256
)
BATCH = 8192  # keys per apply while loading


def _percentiles(samples: list[float]) -> dict[str, float]:
    arr = np.array(samples) * 1e3
    return {
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
        "n": len(samples),
    }


def _timed(fn: Callable[[], Any], n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


# -- query ------------------------------------------------------------------------------------


def load_index(index: ChunkIndex, entries: int, instances: int, tokens: np.ndarray) -> list[bytes]:
    """Fill ``index`` to ``entries`` entries; returns the keys of the prompt the bench asks."""
    ns_id = index.register_namespace(NS)
    names = [f"vllm-{i:02d}" for i in range(instances)]
    for i, name in enumerate(names):
        reg = Registration(name, LocationKind.INSTANCE, (ns_id,), node=f"node-{i // 8}")
        index.register(reg)
    for node in ("node-0", "node-1"):
        index.register(Registration(node, LocationKind.NODE, (ns_id,), node=node))
    keys = chunk_keys(ns_id, tokens, NS.chunk_tokens)
    n = len(keys)
    planted = 0
    for j in range(8):  # the asked prompt: 8 holders, runs n, 7n/8, ..., n/8
        run = n - j * n // 8
        ops = [ChunkOp(EventKind.STORED, Tier.GPU, ns_id, tuple(keys[:run]))]
        if j < 4:
            ops.append(ChunkOp(EventKind.STORED, Tier.CPU, ns_id, tuple(keys)))
            planted += n
        index.apply(names[j * instances // 8], ops)
        planted += run
    for node in ("node-0", "node-1"):
        index.apply(node, [ChunkOp(EventKind.STORED, Tier.CPU, ns_id, tuple(keys))])
        planted += n
    rest = max(entries - planted, 0)
    per = rest // instances
    rng = np.random.default_rng(1)
    with tqdm(total=rest, desc=f"load {type(index).__name__}", unit="entry") as bar:
        for i, name in enumerate(names):
            todo = per + (rest - per * instances if i == 0 else 0)
            while todo:
                take = min(todo, BATCH)
                blob = rng.bytes(16 * take)
                batch = tuple(blob[k : k + 16] for k in range(0, len(blob), 16))
                tier = Tier.GPU if rng.random() < 0.8 else Tier.CPU
                index.apply(name, [ChunkOp(EventKind.STORED, tier, ns_id, batch)])
                todo -= take
                bar.update(take)
    return keys


def measure_queries(
    index: ChunkIndex, keys: list[bytes], tokens: np.ndarray, n: int
) -> dict[str, dict]:
    ns_id = NS.root_key()
    miss = chunk_keys(ns_id, tokens[::-1].copy(), NS.chunk_tokens)
    by_keys, by_tokens, missing = (
        Query(ns_id, keys=keys),
        Query(ns_id, tokens=[int(t) for t in tokens]),
        Query(ns_id, keys=miss),
    )
    result = index.query_one(by_keys)
    assert len(result.holdings) == 10 and result.holdings[0].total == len(keys), result
    return {
        "query by keys": _percentiles(_timed(lambda: index.query_one(by_keys), n)),
        "query by token ids": _percentiles(_timed(lambda: index.query_one(by_tokens), n // 4)),
        "query, nobody holds it": _percentiles(_timed(lambda: index.query_one(missing), n)),
    }


def memory_floor(index: MemoryIndex, keys: list[bytes], n: int) -> dict[str, dict]:
    holders = index._holders  # the floor: what any hash-map index must at least do
    return {
        "floor: 512 dict lookups": _percentiles(_timed(lambda: [holders.get(k) for k in keys], n))
    }


def keys_floor(tokens: np.ndarray, n: int) -> dict[str, dict]:
    root = NS.root_key()
    timed = _timed(lambda: chunk_keys(root, tokens, NS.chunk_tokens), n)
    return {"floor: keying the prompt (SHA-256)": _percentiles(timed)}


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:

    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: pass --redis-url or install redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    client.close()
    return proc, url


def run_queries(
    backends: list[str],
    entries: int,
    instances: int,
    n_tokens: int,
    n: int,
    redis_urls: dict[str, str | None],
    shards: int = 6,
) -> list[dict]:
    tokens = np.random.default_rng(0).integers(0, 150_000, n_tokens, dtype=np.uint32)
    reports = []
    for backend in backends:
        rows: dict[str, dict] = {}
        if backend == "memory":
            index = MemoryIndex()
            keys = load_index(index, entries, instances, tokens)
            gc.collect()
            gc.freeze()
            rows |= measure_queries(index, keys, tokens, n)
            rows |= memory_floor(index, keys, n)
            index.close()
            gc.unfreeze()
        else:
            from kvtier.bench.micro import index_redis

            url = redis_urls.get(backend)
            with index_redis.redis_index(backend, url, "kvtier:index:", shards) as (
                redis_index,
                _,
            ):
                keys = load_index(redis_index, entries, instances, tokens)
                rows |= measure_queries(redis_index, keys, tokens, max(n // 4, 100))
                rows |= index_redis.query_floor(redis_index, keys, max(n // 4, 100))
        rows |= keys_floor(tokens, 50)
        reports.append({"backend": backend, "rows": rows})
    return reports


# -- ingest -----------------------------------------------------------------------------------


def vllm_stream(prompts: int, seed: int = 0) -> tuple[list[bytes], int]:
    """BlockStored payloads as a vLLM engine would publish them; returns (payloads, blocks)."""
    bs, step_blocks, prompt_blocks = 16, 128, 512
    rng = random.Random(seed)
    payloads: list[bytes] = []
    history: list[list[int | bytes]] = []
    blocks = 0
    next_hash = iter(range(1, 1 << 62))
    for p in range(prompts):
        parent, shared = None, 0
        if history and p % 2:  # extend an earlier prompt from an arbitrary block
            prev_hashes = rng.choice(history)
            shared = rng.randrange(1, len(prev_hashes))
            parent = prev_hashes[shared - 1]
        hashes: list[int | bytes] = []
        todo = prompt_blocks - shared
        while todo:
            n = min(step_blocks, todo)
            new: list[int | bytes] = [next(next_hash) for _ in range(n)]
            tokens = [rng.randrange(150_000) for _ in range(n * bs)]
            event = BlockStored(
                block_hashes=new, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                kv_cache_spec_kind="full_attention",
            )  # fmt: skip
            payloads.append(encode_batch(time.time(), [event]))
            parent = new[-1]
            hashes += new
            todo -= n
            blocks += n
        history.append(hashes)
    return payloads, blocks


def measure_ingest(prompts: int, repeat: int) -> dict[str, Any]:
    payloads, blocks = vllm_stream(prompts)
    out: dict[str, Any] = {"blocks": blocks, "payloads": len(payloads)}

    def decode_only() -> None:
        decoder = EventBatchDecoder()
        for payload in payloads:
            decoder.decode(payload)

    def ingest(feed: bool = False) -> None:
        index: ChunkIndex = MemoryIndex()
        if feed:  # as ``kvtier index serve`` runs it: every write also goes to the change feed
            index = FeedingIndex(index, ChangeFeed())
        ns_id = index.register_namespace(NS)
        index.register(Registration("vllm-0", LocationKind.INSTANCE, (ns_id,)))
        mapper, decoder = BlockMapper([NS]), EventBatchDecoder()
        for payload in payloads:
            _, events, _ = decoder.decode(payload)
            mapper.feed(events)
            index.apply("vllm-0", mapper.take_ops())
        assert mapper.counts["opaque"] == 0

    for label, tuned in (("tuned collector (as served)", True), ("default collector", False)):
        for name, fn in (
            ("decode only (floor)", decode_only),
            ("decode + map + index", ingest),
            ("decode + map + index + change feed", lambda: ingest(feed=True)),
        ):
            best_wall = best_cpu = float("inf")
            for _ in range(repeat):
                gc.collect()
                if tuned:
                    gc.freeze()
                    gc.set_threshold(50_000, 50, 100)
                wall, cpu = time.perf_counter(), time.process_time()
                fn()
                best_wall = min(best_wall, time.perf_counter() - wall)
                best_cpu = min(best_cpu, time.process_time() - cpu)
                gc.unfreeze()
                gc.set_threshold(700, 10, 10)
            out[f"{name}, {label}"] = {
                "blocks_per_s": blocks / best_wall,
                "blocks_per_cpu_s": blocks / best_cpu,
            }
    return out


def run(
    backends: list[str],
    entries: int = 1_000_000,
    instances: int = 64,
    tokens: int = 131072,
    queries: int = 2000,
    redis_urls: dict[str, str | None] | None = None,
    ingest_prompts: int = 200,
    redis_ingest_prompts: int = 1000,
    repeat: int = 5,
    cluster_shards: int = 6,
) -> dict:
    from kvtier.bench.micro import index_redis

    redis_urls = redis_urls or {}
    ingest = measure_ingest(ingest_prompts, repeat)
    served = ingest["decode + map + index + change feed, tuned collector (as served)"]
    redis_backends = [b for b in backends if b != "memory"]
    return {
        "entries": entries,
        "instances": instances,
        "tokens": tokens,
        "chunks": tokens // NS.chunk_tokens,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
        "cluster_shards": cluster_shards,
        "query": run_queries(
            backends, entries, instances, tokens, queries, redis_urls, cluster_shards
        ),
        "ingest": ingest,
        "redis_ingest": index_redis.run(
            redis_backends, redis_urls, redis_ingest_prompts, cluster_shards
        ),
        "fleet": index_redis.fleet_rows(served["blocks_per_s"]),
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    out = console()
    for part in report["query"]:
        table = Table(
            title=f"{part['backend']} index: one query of a {report['tokens']:,}-token prompt "
            f"({report['chunks']} chunks), {report['entries']:,} entries over "
            f"{report['instances']} instances"
        )
        for col in ("what", "p50 ms", "p99 ms", "mean ms", "samples"):
            table.add_column(col, justify="right")
        for what, row in part["rows"].items():
            table.add_row(
                what, f"{row['p50_ms']:.3f}", f"{row['p99_ms']:.3f}", f"{row['mean_ms']:.3f}",
                str(row["n"]),
            )  # fmt: skip
        out.print(table)
    ingest = report["ingest"]
    table = Table(
        title=f"vLLM BlockStored ingest, one thread: {ingest['blocks']:,} blocks in "
        f"{ingest['payloads']:,} batches (best of rounds)"
    )
    for col in ("what", "blocks/s", "blocks per CPU-s"):
        table.add_column(col, justify="right")
    for what, row in ingest.items():
        if isinstance(row, dict):
            table.add_row(what, f"{row['blocks_per_s']:,.0f}", f"{row['blocks_per_cpu_s']:,.0f}")
    out.print(table)
    fleet = report["fleet"]
    table = Table(
        title="ingest the fleet needs: an instance prefilling without pause emits "
        f"{fleet['events_per_instance_s']:,.0f} block events/s (stored + removed)"
    )
    for col in ("index", "masters", "namespaces", "batches per apply", "blocks/s, one client",
                "server CPU s/master", "capacity blocks/s", "instances held"):  # fmt: skip
        table.add_column(col, justify="right")
    memory = fleet["memory_instances_held"] * fleet["events_per_instance_s"]
    table.add_row(
        "memory (one process, as served)", "-", "any", "-", f"{memory:,.0f}", "-",
        f"{memory:,.0f}",
        f"{fleet['memory_instances_held']:,.0f}",
    )  # fmt: skip
    for row in report["redis_ingest"]:
        table.add_row(
            row["backend"] + (f", {row['shards']} shards" if "cluster" in row["backend"] else ""),
            str(row["masters"]), str(row["namespaces"]), str(row.get("coalesce", 1)),
            f"{row['blocks_per_s_one_client']:,.0f}",
            " / ".join(f"{s:.2f}" for s in row["server_cpu_s_per_master"]),
            f"{row['capacity_blocks_per_s']:,.0f}", f"{row['instances_held']:,.0f}",
        )  # fmt: skip
    out.print(table)
    out.print(f"machine: {report['cpus']} CPUs, load average {report['load_avg']:.2f} at start")
