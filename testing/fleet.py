"""A whole kvtier cluster on this machine, as real processes: the index, one store per "node"
(loopback, each its own pool and transfer engine), vLLM CPU servers with the kvtier connector
on each node, and the router in front. Used by ``kvtier demo`` (``make run``) and ``kvtier
bench cluster``; ``stop`` leaves no process and no shared-memory segment behind.

Engines reach their node's store over its Unix socket; stores reach each other (remote tier)
and the index over loopback TCP; the index follows every store and engine it is told about by
their own announcements; the router finds the engines through the index.

Without kvtier (``kvtier=False``: vLLM alone, or a peer connector from ``peer_transfer``)
nothing announces: with ``kv_events`` the index is configured to follow every engine's KV
events itself (``index serve --vllm``, a namespace made up here from the model's geometry:
the router keys prompts in it, the index keys the events' tokens in it, so they agree) and
the router finds the engines through the index as before; without events the router gets
them as static ``--backend`` URLs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.store.client.control import SOCKET_PATH_MAX
from kvtier.testing.models import cpu_binding
from kvtier.testing.ports import free_port
from kvtier.testing.services import Service, _start, start_store
from kvtier.testing.vllm_driver import kvtier_transfer_config
from kvtier.testing.vllm_server import MODEL_NAME, VllmServer


@dataclass
class FleetSpec:
    nodes: int = 2
    instances_per_node: int = 2
    pool: str = "1GiB"  # each node store's DRAM pool
    kvtier: bool = True  # connector + node stores; False: vLLM alone (its own prefix cache)
    remote: bool = True  # stores serve and pull each other's chunks
    kv_events: bool = True  # engines publish KV events (the index learns their GPU contents)
    policy: str = "kvtier"
    chunk_tokens: int = 64
    block_size: int = 32
    kv_cache_bytes: int = 32 << 20  # each engine's "GPU" KV: small, so working sets spill
    max_model_len: int = 4096
    extra_vllm_args: list[str] = field(default_factory=list)
    connector_extra: dict = field(default_factory=dict)
    # kvtier=False: a node -> the kv-transfer-config of a peer connector (LMCache's per node)
    peer_transfer: Callable[[str], dict] | None = None
    vllm_env: dict[str, str] = field(default_factory=dict)  # added to every engine's env
    router_env: dict[str, str] = field(default_factory=dict)  # e.g. KVTIER_ROUTER__OFFLOAD


@dataclass
class Instance:
    name: str
    node: str
    server: VllmServer

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class _Plan:
    """An engine's name, node and ports, chosen before anything starts (the index may have to
    be told where its events are)."""

    name: str
    node: str
    port: int
    events: dict | None


class Fleet:
    def __init__(self, spec: FleetSpec, model: Path, workdir: Path) -> None:
        self.spec = spec
        self.model = model
        self.workdir = workdir
        # Unix sockets (a store's gRPC socket, its control socket in its run dir) must fit
        # SOCKET_PATH_MAX bytes: under a deep workdir they go to a short temporary folder,
        # removed at stop (else the store fails to bind, or its engines fall back to gRPC)
        self._short: Path | None = None
        self.index: Service | None = None
        self.stores: dict[str, Service] = {}
        self.instances: list[Instance] = []
        self.router: Service | None = None

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return f"http://{self.router.ready['http']}"

    def start(self, say: Callable[[str], None] = lambda _: None) -> Fleet:
        """Everything up and ready (or everything stopped and the error raised)."""
        try:
            self._start(say)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, say: Callable[[str], None]) -> None:
        spec = self.spec
        self.workdir.mkdir(parents=True, exist_ok=True)
        nodes = [f"node{n}" for n in range(spec.nodes)]
        plans = [
            self._plan(node, f"{node}-vllm{i}")
            for node in nodes
            for i in range(spec.instances_per_node)
        ]
        follow = self._vllm_sources(plans) if spec.kv_events and not spec.kvtier else []
        index_args = ["index", "serve", "--grpc-port", "0", "--http-port", "0"]
        for source in follow:
            index_args += ["--vllm", json.dumps(source)]
        self.index = _start(index_args)
        following = " (follows the engines' KV events)" if follow else ""
        say(f"index     {self.index.address}{following}")
        if spec.kvtier:
            for node in nodes:
                run_dir = self._socket_dir(f"run-{node}")
                extra = ["--index", self.index.address, "--unix-socket", str(self._socket(node))]
                store = start_store(
                    run_dir, spec.pool, node, remote=spec.remote, extra=tuple(extra)
                )
                self.stores[node] = store
                where = f"{store.address}, unix:{self._socket(node)}"
                say(f"store     {node}: {spec.pool} pool, {where}")
        for slot, plan in enumerate(plans):
            self.instances.append(self._instance(plan, slot, len(plans)))
        for inst in self.instances:  # started together, waited for one by one
            inst.server.wait_ready()
            say(f"vLLM      {inst.name} on {inst.node}: {inst.url}")
        static = not spec.kvtier and not spec.kv_events  # nobody tells the index about them
        if not static:
            self._wait_announced()
        router_args = [
            "router", "serve", "--port", "0", "--index", self.index.address,
            "--model", str(self.model), "--policy", spec.policy,
            "--decision-log", str(self.workdir / "decisions.jsonl"),
        ]  # fmt: skip
        for inst in self.instances if static else []:
            router_args += ["--backend", inst.url]
        self.router = _start(router_args, env=spec.router_env or None)
        say(f"router    {self.router_url} ({spec.policy})")

    def _socket(self, node: str) -> Path:
        return self._socket_dir(f"sock-{node}") / "store.sock"

    def _socket_dir(self, name: str) -> Path:
        """``workdir / name``, or the same name in a short temporary folder when a socket in
        it (``ctl-<16 hex>.sock``, the longest) would not fit a socket address."""
        if len(os.fsencode(self.workdir / name / f"ctl-{0:016x}.sock")) <= SOCKET_PATH_MAX:
            return self.workdir / name
        if self._short is None:
            self._short = Path(tempfile.mkdtemp(prefix="kvtier-fleet-"))
        return self._short / name

    def _plan(self, node: str, name: str) -> _Plan:
        events = None
        if self.spec.kv_events:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
        return _Plan(name, node, free_port(), events)

    def _vllm_sources(self, plans: list[_Plan]) -> list[dict]:
        """``index.vllm`` sources: the index follows each engine's events, announces its API."""
        namespace = events_namespace(self.model, self.spec.chunk_tokens)
        return [
            {
                "instance": p.name,
                "endpoint": p.events["endpoint"],
                "replay_endpoint": p.events["replay_endpoint"],
                "namespaces": [namespace],
                "node": p.node,
                "api": f"http://127.0.0.1:{p.port}",
            }
            for p in plans
            if p.events is not None
        ]

    def _instance(self, plan: _Plan, slot: int, slots: int) -> Instance:
        """Engine ``slot`` of ``slots``: it computes on a core of its own where there are
        enough, round robin where not (``cpu_binding``), whatever its connector."""
        spec = self.spec
        node, name, port = plan.node, plan.name, plan.port
        args = list(spec.extra_vllm_args)
        env = {
            "KVTIER_STORE__RUN_DIR": str(self.workdir / f"run-{name}"),
            **cpu_binding(slot, slots),
            **spec.vllm_env,
        }
        if plan.events is not None:
            args += ["--kv-events-config", json.dumps(plan.events)]
        if spec.peer_transfer is not None and not spec.kvtier:
            args += ["--kv-transfer-config", json.dumps(spec.peer_transfer(node))]
        if spec.kvtier:
            assert self.index is not None
            extra = {
                "store_address": f"unix:{self._socket(node)}",
                "index_address": self.index.address,
                "instance_id": name,
                "instance_api": f"http://127.0.0.1:{port}",
                "chunk_tokens": spec.chunk_tokens,
                "tiers": ["cpu", "remote"] if spec.remote else ["cpu"],
                **spec.connector_extra,
            }
            args += ["--kv-transfer-config", json.dumps(kvtier_transfer_config(extra))]
        server = VllmServer(
            self.model,
            self.workdir / f"{name}.log",
            kv_cache_bytes=spec.kv_cache_bytes,
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            extra_args=args,
            env=env,
            port=port,
        )
        return Instance(name, node, server)

    def _wait_announced(self) -> None:
        """Until the index knows every engine (the router finds them there), for as long as
        the index and every engine run: one that exited fails it at once; a loaded machine
        only makes it slower."""
        from kvtier.core.errors import ErrorCode, KvtierError
        from kvtier.index.client.grpc import GrpcIndexClient

        assert self.index is not None
        index = self.index
        client = GrpcIndexClient(index.address)
        names = {i.name for i in self.instances}
        try:
            while True:
                try:
                    known = {
                        info.registration.location
                        for info in client.locations()
                        if info.registration.endpoints.get("api")
                    }
                except KvtierError as exc:  # slow to answer: ask again while it runs
                    if exc.code is not ErrorCode.UNAVAILABLE:
                        raise
                    known = set()
                if names <= known:
                    return
                if index.proc.poll() is not None:
                    raise RuntimeError(f"the index exited ({index.proc.returncode})")
                for inst in self.instances:
                    if inst.server.proc.poll() is not None:
                        log = inst.server.log_path
                        raise RuntimeError(f"vLLM {inst.name} exited; see {log}")
                time.sleep(0.3)
        finally:
            client.close()

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for inst in self.instances:
            inst.server.stop()
        for store in self.stores.values():
            store.stop()
        if self.index is not None:
            self.index.stop()
        self.instances, self.stores, self.router, self.index = [], {}, None, None
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
            self._short = None


def events_namespace(model: Path, chunk_tokens: int) -> dict:
    """The namespace an index following vLLM's events keys them in (no connector names one):
    the model's KV geometry from its config.json, fp32 as ``VllmServer`` runs it."""
    from kvtier.core.keys import Namespace

    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    namespace = Namespace(
        model=MODEL_NAME,
        dtype="float32",
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_size=config.get("head_dim") or config["hidden_size"] // heads,
        kv_layout="vllm-events",
        chunk_tokens=chunk_tokens,
    )
    return namespace.model_dump(mode="json")


def completion(url: str, prompt: str, max_tokens: int = 1, **extra: object) -> tuple[dict, float]:
    """One streamed completion: (the final usage/served-by facts, seconds to the first byte)."""
    import httpx

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    usage: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        served_by = resp.headers.get("x-kvtier-instance", "")
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: "):
                ttft = time.perf_counter() - start
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    return {"usage": usage, "served_by": served_by}, ttft or 0.0


__all__ = ["Fleet", "FleetSpec", "Instance", "completion", "events_namespace"]
