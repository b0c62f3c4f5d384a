"""The README's ``Using it with vLLM``, as a user types it: a node store on a Unix socket, then
``vllm serve MODEL --kv-transfer-config ...`` (vLLM's own console script, which works because
install.sh records the CPU build as ``vllm``), answering a completion whose KV reaches the store.
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

import pytest

from kvtier.testing.models import VLLM_ENV, make_model
from kvtier.testing.ports import free_port
from kvtier.testing.services import start_store
from kvtier.testing.vllm_driver import kvtier_transfer_config

pytestmark = pytest.mark.vllm

VLLM = Path(sys.executable).parent / "vllm"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


def test_vllm_serve_with_the_connector(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    sock = tmp_path / "sock" / "store.sock"
    store = start_store(
        tmp_path / "run", "64MiB", "readme-node", remote=False, extra=("--unix-socket", str(sock))
    )
    port = free_port()
    extra = {"store_address": f"unix:{sock}"}
    env = {**os.environ, **VLLM_ENV, "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as `vllm serve` runs by default
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:
        # README flags plus what a 2-core CI machine needs (fp32, eager, a small KV cache)
        server = subprocess.Popen(
            [
                str(VLLM),
                "serve",
                str(model),
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--max-model-len",
                "2048",
                "--enforce-eager",
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--kv-transfer-config",
                json.dumps(kvtier_transfer_config(extra)),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-4000:]}"
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.5)
        prompt = " ".join(f"t{i % 500}" for i in range(600))  # two 256-token chunks and more
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["choices"][0]["text"]
        metrics = _get(f"http://127.0.0.1:{port}/metrics").decode()
        assert "vllm:kvtier_" in metrics  # the connector is loaded and reporting
        deadline = time.monotonic() + 30
        while True:  # the prompt's chunks reach the node store
            stats = json.loads(_get(f"{store.http}/stats"))
            if stats["chunks"] >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert stats["chunks"] >= 2, stats
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        store.stop()
