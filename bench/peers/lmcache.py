"""LMCache 0.5.x in its multiprocess mode: ``lmcache server`` (CPU DRAM L1) + vLLM's
``LMCacheMPConnector``, the configuration LMCache recommends for production.

Installed by ``scripts/install.sh all`` (``lmcache==0.5.6 --no-deps``: on CPU none of its CUDA
dependencies are imported). Settings follow a colleague's tested recipe: the server's transfer
mode must be ``engine_driven`` for CPU workers (else vLLM waits 300 s at start), ``--shm-name``
lets workers copy straight into the server's L1, and the chunk size must be a multiple of
vLLM's block size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier.testing.ports import free_port

PRELOAD = "kvtier.bench.peers.lmcache_compat"  # must be imported before vLLM in-process


class LMCacheServer:
    """``lmcache server`` in its own process group."""

    def __init__(
        self,
        log_path: Path,
        l1_gb: float = 4.0,
        chunk_size: int = 256,
        l2_disk: Path | None = None,
    ) -> None:
        """``l2_disk``: a directory for LMCache's native filesystem L2 (``fs_native``: files
        written behind its L1, read back into L1 on a hit)."""
        self.port, self.http_port = free_port(), free_port()
        self.shm_name = f"kvtier_lmc_{os.getpid()}"
        self.log_path = log_path
        lmcache = Path(sys.executable).with_name("lmcache")
        self.cmd = [
            str(lmcache),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(chunk_size),
            "--l1-size-gb",
            str(l1_gb),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            self.shm_name,
            "--disable-metrics",
        ]
        if l2_disk is not None:
            adapter = {"type": "fs_native", "base_path": str(l2_disk)}
            self.cmd += ["--l2-adapter", json.dumps(adapter)]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        log_path = self.log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/healthcheck"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited; see {log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if json.loads(resp.read()).get("status") == "healthy":
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"lmcache server not healthy in {timeout} s; see {log_path}")

    def kv_transfer_config(self) -> dict:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
                "lmcache.mp.mq_timeout": 60,
            },
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc is not None:
            self._log.close()
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)
