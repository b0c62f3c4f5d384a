"""What scraping the instances' ``/metrics`` costs the requests a router is serving.

    kvtier bench router-scrape [--instances 16] [--seconds 15] [--repeats 3]

A real ``kvtier router serve`` process in front of ``--instances`` stand-in instances (one
asyncio process on loopback: each answers a completion at once and serves a ``/metrics`` page
shaped like vLLM 0.32's, ``router.vllm_shaped_page``; the router tokenizes with a BPE trained
here, ``router.make_tokenizer``), one request at a time through it for
``--seconds``. Two configurations on fresh router processes, interleaved, ``--repeats`` times:
scraping every instance every second (``router.scrape_s`` 1, the default) and, the floor,
scraping once at start (``scrape_s`` 3600). Reported: request latency p50 / p99 / max through
the router and the router's CPU seconds. The stand-ins share this host's cores, so compare the
two rows of one run, not a row with another host's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kvtier.bench.micro.router import make_tokenizer, vllm_shaped_page
from kvtier.testing.ports import free_port
from kvtier.testing.services import _start

# router.scrape_s of each configuration; None: no router, straight to one instance
CONFIGS: dict[str, str | None] = {
    "scrape every 1 s": "1.0",
    "floor: scrape once": "3600",
    "floor: no router, straight to an instance": None,
}
COMPLETION = b'{"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 8}}'
MODELS = b'{"data": [{"id": "stub"}]}'


def _response(body: bytes, kind: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(body))
    return head + body


def _serve_instances(ports: list[int], page: str) -> None:
    """Minimal HTTP/1.1 instances (keep-alive; only what the router asks for): cheap, so the
    router, not the stand-ins, is what the figures measure."""
    answers = {
        b"/metrics": _response(page.encode(), b"text/plain"),
        b"/v1/models": _response(MODELS, b"application/json"),
        b"/v1/completions": _response(COMPLETION, b"application/json"),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                writer.write(answers.get(path, answers[b"/v1/completions"]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        servers = [await asyncio.start_server(handle, "127.0.0.1", p) for p in ports]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


def _one_run(
    urls: list[str], scrape_s: str | None, seconds: float, model: Path
) -> dict[str, float]:
    if scrape_s is None:
        return _requests(urls[0], seconds, None)
    env = {"KVTIER_ROUTER__SCRAPE_S": scrape_s}
    args = ["router", "serve", "--port", "0", "--policy", "lmetric", "--model", str(model)]
    for url in urls:
        args += ["--backend", url]
    router = _start(args, env=env)
    try:
        return _requests(f"http://{router.ready['http']}", seconds, router.proc.pid)
    finally:
        router.stop()


def _requests(base: str, seconds: float, router_pid: int | None) -> dict[str, float]:
    """One request at a time to ``base`` for ``seconds``; latencies and the router's CPU."""
    body = {"model": "stub", "prompt": "hello world", "max_tokens": 1}
    latencies: list[float] = []
    with httpx.Client(timeout=30) as client:
        deadline = time.monotonic() + 30
        while client.post(f"{base}/v1/completions", json=body).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the router never routed to the stand-in instances")
            time.sleep(0.2)
        time.sleep(2.0)  # a scrape or two first
        cpu_start = _cpu_s(router_pid) if router_pid else 0.0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            resp = client.post(f"{base}/v1/completions", json=body)
            latencies.append(time.perf_counter() - start)
            resp.raise_for_status()
            time.sleep(0.005)
        cpu = _cpu_s(router_pid) - cpu_start if router_pid else 0.0
    latencies.sort()
    return {
        "requests": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
        "max_ms": latencies[-1] * 1e3,
        "router_cpu_per_s": cpu / seconds,
    }


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run(instances: int = 16, seconds: float = 15.0, repeats: int = 3) -> dict[str, Any]:
    page = vllm_shaped_page()
    ports = [free_port() for _ in range(instances)]
    stand_ins = multiprocessing.get_context("spawn").Process(
        target=_serve_instances, args=(ports, page), daemon=True
    )
    stand_ins.start()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-router-scrape-")
    try:
        model = make_tokenizer(Path(tmp.name) / "tok")  # the router tokenizes locally
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with tqdm(total=repeats * len(CONFIGS), desc="router runs", unit="run") as bar:
            for r in range(repeats):
                order = list(CONFIGS.items())
                if r % 2:  # interleaved: alternate which goes first
                    order.reverse()
                for name, scrape_s in order:
                    runs[name].append(_one_run(urls, scrape_s, seconds, model))
                    bar.update(1)
    finally:
        stand_ins.terminate()
        stand_ins.join()
        tmp.cleanup()
    return {
        "instances": instances,
        "seconds": seconds,
        "page_bytes": len(page),
        "runs": runs,
    }


def print_report(report: dict) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"requests through the router while it scrapes {report['instances']} instances' "
        f"/metrics ({report['page_bytes'] / 1024:.0f} KiB pages), {report['seconds']:.0f} s a "
        "run, fresh router per run"
    )
    for col in ("configuration", "run", "requests", "p50 ms", "p99 ms", "max ms", "router CPU"):
        table.add_column(col, justify="right")
    for name, rows in report["runs"].items():
        for i, row in enumerate(rows):
            table.add_row(
                name, str(i + 1), str(row["requests"]), f"{row['p50_ms']:.2f}",
                f"{row['p99_ms']:.2f}", f"{row['max_ms']:.1f}",
                f"{row['router_cpu_per_s']:.0%}" if CONFIGS.get(name) else "-",
            )  # fmt: skip
    console().print(table)
