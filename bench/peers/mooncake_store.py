"""Mooncake Store on loopback, as the peer of ``kvtier bench remote``.

Starts ``mooncake_master`` and one holder process (a ``MooncakeDistributedStore`` mounting a
global segment, where objects live); the benchmark's own client mounts no segment, so every
get is a transfer-engine read from the holder, like a kvtier remote fetch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.testing.ports import free_port

HOLDER = r"""
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[1]), 16 << 20, "tcp", "", sys.argv[2])
print("READY", rc, flush=True)
sys.stdin.read()
s.close()
"""


class MooncakeStoreHarness:
    """Master + holder processes and a reading client in this process."""

    def __init__(self, segment_bytes: int, log_dir: Path) -> None:
        import mooncake
        from mooncake.store import MooncakeDistributedStore

        master_bin = Path(mooncake.__file__).parent / "mooncake_master"
        port, metrics_port = free_port(), free_port()
        self.master = subprocess.Popen(
            [
                str(master_bin),
                f"--rpc_port={port}",
                f"--metrics_port={metrics_port}",
                "--enable_http_metadata_server=false",
                "--enable_metric_reporting=false",
            ],
            stdout=open(log_dir / "mooncake_master.log", "w"),  # noqa: SIM115 - lives with it
            stderr=subprocess.STDOUT,
        )
        self.holder: subprocess.Popen | None = None
        try:
            address = f"127.0.0.1:{port}"
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or self.master.poll() is not None:
                        raise RuntimeError("mooncake_master did not start") from None
                    time.sleep(0.05)
            self.holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, str(segment_bytes), address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log_dir / "mooncake_holder.log", "w"),  # noqa: SIM115
                text=True,
            )
            assert self.holder.stdout is not None
            line = self.holder.stdout.readline().split()
            if line[:2] != ["READY", "0"]:
                raise RuntimeError(f"Mooncake Store holder failed to start: {line}")
            self.client = MooncakeDistributedStore()
            rc = self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address)
            if rc != 0:
                raise RuntimeError(f"Mooncake Store client setup failed: {rc}")
        except BaseException:
            self.close()
            raise

    def register(self, addr: int, size: int) -> None:
        rc = self.client.register_buffer(addr, size)
        if rc != 0:
            raise RuntimeError(f"register_buffer failed: {rc}")

    def put(self, keys: list[str], addrs: list[int], size: int) -> None:
        for key, addr in zip(keys, addrs, strict=True):
            rc = self.client.put_from(key, addr, size)
            if rc != 0:
                raise RuntimeError(f"put_from({key}) failed: {rc}")

    def get_into(self, key: str, addr: int, size: int) -> None:
        got = self.client.get_into(key, addr, size)
        if got != size:
            raise RuntimeError(f"get_into({key}) returned {got}")

    def batch_get_into(self, keys: list[str], addrs: list[int], size: int) -> None:
        got = self.client.batch_get_into(keys, addrs, [size] * len(keys))
        if any(g != size for g in got):
            raise RuntimeError(f"batch_get_into returned {got}")

    def remove(self, keys: list[str]) -> None:
        # force: a get leaves a lease (10 s by default) that would otherwise block the remove
        for key in keys:
            self.client.remove(key, True)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()
        if self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGTERM)
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()
