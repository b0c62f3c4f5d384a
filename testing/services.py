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

    @property
    def pid(self) -> int:
        """The service's process: the one that printed the ready line (``ready["pid"]`` when
        someone else started it, as a restarted store's ready file says)."""
        return int(self.ready.get("pid", self.proc.pid))

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


def process_state(pid: int) -> str:
    """``running``, ``stopped`` (SIGSTOP: it answers nothing until continued) or ``gone``
    (exited, a zombie not yet reaped included), read from /proc: for any process, not only
    a child of this one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = stat.rpartition(")")[2].split()[0]  # the name, in parentheses, may hold spaces
    if state in ("Z", "X", "x"):
        return "gone"
    return "stopped" if state in ("T", "t") else "running"


def store_stats(address: str, pid: int, retry_s: float = 0.1) -> dict | None:
    """A store's stats over gRPC, or None once its process ``pid`` has exited (whatever it
    held died with it). Asked for as long as that process lives: on a loaded machine a store
    may be slow to complete a connection (gRPC gives a connection attempt as little as the
    channel's reconnect backoff, 100 ms to 1 s here) or to answer within one call's
    deadline, which is no reason to give up; its process exiting is the one reason to stop.
    (A store someone froze with SIGSTOP is waited for too, until it is continued.)"""
    from kvtier.core.errors import ErrorCode, KvtierError
    from kvtier.store.client.grpc import GrpcStoreClient

    client = GrpcStoreClient(address, lazy=True)
    try:
        while True:
            try:
                return client.stats()
            except KvtierError as exc:
                if exc.code is not ErrorCode.UNAVAILABLE:
                    raise
                if process_state(pid) == "gone":
                    return None
            time.sleep(retry_s)
    finally:
        client.close()


def store_leases(address: str, pid: int) -> int:
    """Read and write leases a store holds now (0 for a store that has exited)."""
    stats = store_stats(address, pid)
    return 0 if stats is None else int(stats["read_leases"]) + int(stats["write_leases"])


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


def disk_env(path: Path, **more: str) -> dict[str, str]:
    """The environment of a store with the disk tier at ``path`` (docs/disk.md), write-through
    and checked every 50 ms, so a test or benchmark finds its chunks on disk at once."""
    return {
        "KVTIER_STORE__DISK__ENABLED": "true",
        "KVTIER_STORE__DISK__PATH": str(path),
        "KVTIER_STORE__DISK__WRITE_THROUGH": "true",
        "KVTIER_STORE__DISK__INTERVAL_S": "0.05",
        **more,
    }


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


def wait_indexed(index: Service, node: str, chunks: int, timeout: float | None = None) -> None:
    """Until the index holds ``chunks`` DRAM entries of ``node`` (learnt from its events), for
    as long as the index runs (one that exited fails it at once; a loaded machine only makes
    it slower). ``timeout`` bounds it too."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{index.http}/locations", timeout=30) as resp:
                for location in json.loads(resp.read()):
                    entries = location["entries"].get("cpu", 0)
                    if location["location"] == node and entries >= chunks:
                        return
        except OSError:  # slow to answer: ask again while it runs
            pass
        if index.proc.poll() is not None:
            raise RuntimeError(f"the index exited ({index.proc.returncode})")
        time.sleep(0.2)
    raise TimeoutError(f"the index did not learn {chunks} chunks of {node} in {timeout} s")
