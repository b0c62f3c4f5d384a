"""The parts of ``kvtier bench cluster`` that talk to the processes: LMCache's servers (the
peer configuration), the replay client that notes which instance served each request, the
warm-up, and reading ``/metrics``."""

from __future__ import annotations

import contextvars
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.testing.fleet import Fleet, FleetSpec
from kvtier.testing.vllm_server import MODEL_NAME
from kvtier.traces.replay import (
    CompletionClient,
    Replayer,
    ReplayItem,
    ReplayResult,
)
from kvtier.traces.server_metrics import parse_prometheus

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvtier.bench.cluster.run import ClusterConfig, Topology

INSTANCE_HEADER = "x-kvtier-instance"


class Peers:
    """LMCache's multiprocess server, one per node (nothing for other configurations)."""

    def __init__(self, cfg: ClusterConfig, topo: Topology, workdir: Path) -> None:
        self.servers: dict[str, Any] = {}
        if cfg.peer not in ("", "lmcache"):
            raise ValueError(f"unknown peer {cfg.peer!r}")
        self.cfg, self.topo, self.workdir = cfg, topo, workdir

    def start(self, spec: FleetSpec, say: Callable[[str], None]) -> None:
        if self.cfg.peer != "lmcache":
            return
        from kvtier.bench.peers.lmcache import PRELOAD, LMCacheServer

        for n in range(self.topo.nodes):
            node = f"node{n}"
            server = LMCacheServer(
                self.workdir / f"lmcache-{node}.log",
                l1_gb=self.topo.pool_bytes / (1 << 30),
                chunk_size=self.topo.chunk_tokens,
            )
            # one shared-memory L1 per node: the default name is per process
            server.shm_name = f"kvtier_lmc_{os.getpid()}_{node}"
            server.cmd[server.cmd.index("--shm-name") + 1] = server.shm_name
            self.servers[node] = server
            server.start()
            say(f"LMCache   {node}: {self.topo.pool} L1, port {server.port}")
        spec.peer_transfer = lambda node: self.servers[node].kv_transfer_config()
        spec.vllm_env = {**spec.vllm_env, **_preload_env(self.workdir, PRELOAD)}

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


def _preload_env(workdir: Path, module: str) -> dict[str, str]:
    """Have every Python process of the engine import ``module`` first (LMCache's
    compatibility fix must be in place before vLLM's CPU platform scans modules): a
    ``sitecustomize`` on PYTHONPATH, which spawned engine processes inherit too."""
    site = workdir / "preload"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import {module}  # noqa: F401\n")
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)}


_served: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "served", default=None
)


class RoutedClient(CompletionClient):
    """The replay client, also noting which instance the router sent each request to."""

    async def __aenter__(self) -> RoutedClient:
        import aiohttp

        async def on_end(session: Any, ctx: Any, params: Any) -> None:
            box = _served.get()  # set by send(): this request's task
            if box is not None:
                box["instance"] = params.response.headers.get(INSTANCE_HEADER, "")

        trace = aiohttp.TraceConfig()
        trace.on_request_end.append(on_end)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20, trace_configs=[trace]
        )
        return self

    async def send(self, item: ReplayItem, start: float) -> ReplayResult:
        box: dict[str, str] = {}
        token = _served.set(box)
        try:
            res = await super().send(item, start)
        finally:
            _served.reset(token)
        res.meta = {**res.meta, "instance": box.get("instance", "")}
        return res


class RoutedReplayer(Replayer):
    """Open loop at the trace's times, with ``RoutedClient``."""

    async def run(self, items: Iterable[ReplayItem]) -> list[ReplayResult]:
        async with RoutedClient(self.opts) as client:
            await self._open_loop(client, items, time.perf_counter())
        return self.results


def get_text(url: str, timeout_s: float = 10.0) -> str:
    import httpx

    return httpx.get(url, timeout=timeout_s).text


def counters(url: str) -> dict[str, float]:
    return parse_prometheus(get_text(f"{url}/metrics"), keep_labels=("source",))


def warm_up(fleet: Fleet, vocab_size: int, tokens: int, seed: int) -> None:
    """One request per instance, straight to it, of tokens no trace prompt starts with (the
    first request of a fresh engine is slower: left out of every figure)."""
    import httpx

    for i, inst in enumerate(fleet.instances):
        rng = random.Random(f"warm-up {seed} {i}")
        prompt = [0, *(rng.randrange(16, vocab_size) for _ in range(tokens - 1))]  # 0: <unk>
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        httpx.post(f"{inst.url}/v1/completions", json=body, timeout=120).raise_for_status()


def wait_routable(fleet: Fleet, timeout_s: float = 30.0) -> None:
    """Until the router knows every instance (it re-reads the index every 2 s)."""
    import httpx

    want = len(fleet.instances)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = httpx.get(f"{fleet.router_url}/readyz", timeout=5)
        if resp.status_code == 200 and resp.json().get("backends", 0) >= want:
            return
        time.sleep(0.3)
    raise TimeoutError(f"the router did not find {want} instances in {timeout_s} s")
