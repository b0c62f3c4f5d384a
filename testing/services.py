"""Start kvtier's services as real processes on this machine (for benchmarks): node stores
(each its own "node": its own pool, its own transfer engine) and an index following them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Service:
    """A kvtier service process (store, index) and the JSON "ready" line it printed."""

    proc: subprocess.Popen
    ready: dict

    @property
    def address(self) -> str:
        return str(self.ready["grpc"])

    @property
    def http(self) -> str:
        return f"http://{self.ready['http']}"

    @property
    def segment(self) -> str:
        """A store's pool segment (its /dev/shm file name)."""
        return str(self.ready["segment"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Stop it (SIGCONT first, in case someone froze it); SIGKILL past ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def kvtier_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvtier", *args]


def _start(
    args: list[str], env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()
) -> Service:
    """``wrapper``: a command prefix, e.g. ``("ip", "netns", "exec", "ns1")``."""
    env = {**os.environ, "KVTIER_LOG_LEVEL": "warning", **(env or {})}
    argv = [*wrapper, *kvtier_argv(args)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"kvtier {' '.join(args[:2])} exited with {proc.wait()}")
    return Service(proc, json.loads(line))


def store_args(
    run_dir: Path,
    capacity: str,
    node_id: str,
    remote: bool = True,
    grpc_port: int = 0,
    extra: tuple[str, ...] = (),
) -> list[str]:
    args = [
        "store",
        "serve",
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        "0",
        "--capacity",
        capacity,
        "--run-dir",
        str(run_dir),
        "--node-id",
        node_id,
        *extra,
    ]
    return [*args, "--remote"] if remote else args


def start_store(
    run_dir: Path,
    capacity: str,
    node_id: str,
    remote: bool = True,
    env: dict[str, str] | None = None,
    grpc_port: int = 0,
    extra: tuple[str, ...] = (),
    wrapper: tuple[str, ...] = (),
) -> Service:
    """A ``kvtier store serve`` process on free ports, ready when this returns."""
    return _start(store_args(run_dir, capacity, node_id, remote, grpc_port, extra), env, wrapper)


def start_index(stores: list[Service]) -> Service:
    args = ["index", "serve", "--grpc-port", "0", "--http-port", "0"]
    for store in stores:
        args += ["--store", store.address]
    return _start(args)


def wait_indexed(index: Service, node: str, chunks: int, timeout: float = 60) -> None:
    """Until the index holds ``chunks`` DRAM entries of ``node`` (learnt from its events)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{index.http}/locations", timeout=5) as resp:
            for location in json.loads(resp.read()):
                if location["location"] == node and location["entries"].get("cpu", 0) >= chunks:
                    return
        time.sleep(0.2)
    raise TimeoutError(f"the index did not learn {chunks} chunks of {node} in {timeout} s")
