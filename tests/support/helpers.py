"""Helpers for tests that need real processes. Imported by spawned children too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.testing.ports import free_port
from kvtier.testing.services import Service, _start, start_store

StoreProcess = Service  # a store process, as the tests call it


def start_store_process(
    run_dir: Path,
    capacity: str = "16MiB",
    *extra: str,
    node_id: str = "test-node",
    env: dict | None = None,
    wrapper: tuple[str, ...] = (),
) -> StoreProcess:
    """``wrapper``: a command prefix, e.g. ``("ip", "netns", "exec", "ns1")``."""
    return start_store(
        run_dir, capacity, node_id, remote=False, env=env, extra=extra, wrapper=wrapper
    )


def chunk_bytes(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


# -- functions run in child processes ----------------------------------------------------------


def child_put(address: str, ns_json: str, chunk_size: int, n: int, seed: int) -> list[str]:
    """Put n chunks (seeded content) through the store at address; returns their keys (hex)."""
    from kvtier.core.config import StoreConfig
    from kvtier.core.keys import Namespace, prompt_keys
    from kvtier.tiers import connect

    ns = Namespace.model_validate_json(ns_json)
    tokens = np.arange(seed * 100_000, seed * 100_000 + n * ns.chunk_tokens, dtype=np.uint32)
    keys = prompt_keys(ns, tokens)
    with connect(StoreConfig(address=address)) as tier:
        ns_id = tier.register_namespace(ns, chunk_size)
        tier.put(ns_id, keys, [chunk_bytes(seed * 1000 + i, chunk_size) for i in range(n)])
    return [k.hex() for k in keys]


def child_get(address: str, ns_json: str, chunk_size: int, keys_hex: list[str]) -> list[bytes]:
    from kvtier.core.config import StoreConfig
    from kvtier.core.keys import Namespace
    from kvtier.tiers import connect

    ns = Namespace.model_validate_json(ns_json)
    with connect(StoreConfig(address=address)) as tier:
        ns_id = tier.register_namespace(ns, chunk_size)
        return tier.get(ns_id, [bytes.fromhex(k) for k in keys_hex])


def child_lease_and_die(
    address: str, ns_json: str, chunk_size: int, keys_hex: list[str], ttl_s: float
) -> None:
    """Take a read lease and die without releasing it (SIGKILL to itself)."""
    from kvtier.core.config import StoreConfig
    from kvtier.core.keys import Namespace
    from kvtier.tiers import connect

    ns = Namespace.model_validate_json(ns_json)
    tier = connect(StoreConfig(address=address))
    ns_id = tier.register_namespace(ns, chunk_size)
    lease = tier.read(ns_id, [bytes.fromhex(k) for k in keys_hex], lease_ttl_s=ttl_s)
    assert len(lease.hits) == len(keys_hex)
    os.kill(os.getpid(), signal.SIGKILL)


# -- Redis ------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A real ``redis-server`` on a free loopback port, no persistence."""

    proc: subprocess.Popen
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        """Stop and start again on the same port (an empty Redis: nothing is persisted)."""
        self.stop()
        fresh = start_redis(self.workdir, self.port)
        self.proc = fresh.proc


def start_redis(workdir: Path, port: int | None = None) -> RedisServer:
    """A ``redis-server`` on ``port`` (default: a free one), once it answers PING: waited for as
    long as it runs (one that exited, e.g. on a port in use, fails at once; a loaded machine
    only makes it slower)."""
    import shutil
    import time

    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server (see .ci/run)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=5)
    try:
        while True:
            try:
                client.ping()
                return RedisServer(proc, port, workdir)
            except (redis.ConnectionError, redis.TimeoutError):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited ({proc.returncode}) before answering on {port}"
                    ) from None
                time.sleep(0.02)
    finally:
        client.close()


# -- index -------------------------------------------------------------------------------------


IndexProcess = Service  # a `kvtier index serve` process and its ready line


def start_index_process(*extra: str, env: dict | None = None) -> Service:
    """``kvtier index serve`` on free ports; returns once it printed its ready line."""
    return _start(["index", "serve", "--grpc-port", "0", "--http-port", "0", *extra], env)


def http_json(url: str, body: object | None = None) -> tuple[int, object]:
    """GET (or POST ``body`` as JSON); returns (status, decoded JSON or text)."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def vllm_start_failure(spec: dict, run_dir: Path, **env: str) -> tuple[int, str]:
    """Start vLLM (``kvtier.testing.vllm_driver``) with a spec expected to be refused at
    start-up: (exit code, stderr)."""
    import sys

    from kvtier.testing.models import vllm_env

    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.testing.vllm_driver"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        env=vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir), **env),
    )
    return proc.returncode, proc.stderr
