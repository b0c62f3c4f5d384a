"""A process that imports vLLM once and forks one child per driver run (tests only).

Importing vLLM takes ~9 s of the ~12.5 s a minimal driver run costs on a 2-core machine, and
the suite makes a hundred runs. With ``KVTIER_VLLM_FORKSERVER`` set to a socket path (the
tests' conftest sets it), ``run_vllm`` asks this server instead of starting a fresh
interpreter: the server forks, and the child takes the caller's environment, working
directory and spec, runs ``vllm_driver.main`` and answers on the connection. Every run still
gets its own process, engine, KV cache and connector; only the imports are shared. Runs that
preload modules before vLLM (a peer's compatibility fix) still start a fresh interpreter.

What a child inherits from the server is what importing ``vllm``, ``torch`` and the driver
does; nothing computes in the server (no OpenMP pool, no CUDA, no engine), so the fork is
clean. The server is single-threaded: it accepts, forks, and lets the kernel reap children
(SIGCHLD ignored). It exits when its socket is removed, or after ``IDLE_S`` without a run.

Protocol: the client sends one JSON object ``{"spec", "env", "cwd", "stdout", "stderr"}`` and
closes its write side; the child sends its pid on one line, then, once its engine is shut
down and its exit hooks ran (as the driver's own process would before exiting), one JSON line
``{"rc": int, "result": [...]}``, and exits. Its stdout and stderr go to the named files.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ENV = "KVTIER_VLLM_FORKSERVER"
IDLE_S = 1800.0
START_TIMEOUT_S = 120.0


def serve(path: Path) -> None:
    from vllm import LLM  # noqa: F401  - the import every child shares

    from kvtier.testing import vllm_driver

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(64)
    server.settimeout(IDLE_S)
    print("ready", flush=True)
    while path.exists():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            break
        if os.fork() == 0:
            server.close()
            _child(conn, vllm_driver.main)
        conn.close()


def _child(conn: socket.socket, main: Any) -> None:
    rc, result = 1, None
    try:
        request = json.loads(_read_all(conn))
        if "module" in request:
            _run_module(conn, request)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # vLLM waits for its own children
        os.setsid()  # a caller's kill of the process group reaches nothing else
        conn.sendall(f"{os.getpid()}\n".encode())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        try:
            result, rc = main(request["spec"]), 0
        except BaseException:
            traceback.print_exc()
        # exit as the driver's own process would (the engine shut down, exit hooks run: the
        # connector ends its store session) before the caller hears the run is over
        gc.collect()
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall((json.dumps({"rc": rc, "result": result}) + "\n").encode())
    finally:
        os._exit(rc)


def _run_module(conn: socket.socket, request: dict) -> None:
    """``python -m <module> <argv>`` in this child (a vLLM OpenAI server): it runs until it
    exits or is signalled; the exit code goes back on the connection."""
    import runpy

    rc = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        conn.sendall(f"{os.getpid()}\n".encode())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as exit_:
            code = exit_.code
            rc = code if isinstance(code, int) else (0 if code is None else 1)
        except BaseException:
            traceback.print_exc()
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall((json.dumps({"rc": rc}) + "\n").encode())
    finally:
        os._exit(rc)


class ForkedProcess:
    """What ``subprocess.Popen`` offers of a process the fork server started: its pid (the
    leader of its own session), ``poll``/``wait``/``returncode`` from the connection it
    answers on when it exits, and signals."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        while not self._buffer.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError("the fork server's child exited before it started")
            self._buffer += chunk
        self.pid = int(self._buffer)
        self._buffer = b""
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                while chunk := self._conn.recv(4096):
                    self._buffer += chunk
                self._finish()  # EOF: the process is gone
            except BlockingIOError:
                pass
        return self.returncode

    def _finish(self) -> None:
        line = self._buffer.strip()
        self.returncode = json.loads(line)["rc"] if line else -signal.SIGKILL
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_module(
    path: Path, module: str, argv: list[str], env: dict[str, str], log: Path
) -> ForkedProcess:
    """``python -m module *argv`` forked from the server, output appended to ``log``."""
    _ensure_server(path)
    request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(log)}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    conn.sendall(json.dumps(request).encode())
    conn.shutdown(socket.SHUT_WR)
    return ForkedProcess(conn)


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def run(path: Path, spec: dict, env: dict[str, str], timeout: float, workdir: Path) -> tuple:
    """One driver run in a forked child: (returncode, result or None, stderr text)."""
    _ensure_server(path)
    stdout, stderr = workdir / "stdout", workdir / "stderr"
    request = {
        "spec": spec,
        "env": env,
        "cwd": os.getcwd(),
        "stdout": str(stdout),
        "stderr": str(stderr),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    pid = 0
    try:
        conn.sendall(json.dumps(request).encode())
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(timeout)
        reader = conn.makefile("rb")
        pid = int(reader.readline() or 0)
        line = reader.readline()
    except TimeoutError:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        raise subprocess.TimeoutExpired("vllm driver (forked)", timeout) from None
    finally:
        conn.close()
    text = stderr.read_text(errors="replace") if stderr.exists() else ""
    if not line:  # the child died without answering (a crash, a signal)
        return -1, None, text
    answer = json.loads(line)
    return answer["rc"], answer["result"], text


def _ensure_server(path: Path) -> None:
    """Start the server unless one answers at ``path`` (several callers: one starts it)."""
    if _alive(path):
        return
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _alive(path):
            return
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.testing.vllm_forkserver", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env={**os.environ, **_server_env()},
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        line = proc.stdout.readline()  # "ready", or EOF if it died
        if line.strip() != "ready" or time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM fork server did not start ({proc.poll()})")
        Path(f"{path}.pid").write_text(str(proc.pid))
    finally:
        os.close(lock)


def _server_env() -> dict[str, str]:
    """What vLLM and its dependencies read once, at import (the same for every run)."""
    from kvtier.testing.models import VLLM_ENV

    return dict(VLLM_ENV)


def _alive(path: Path) -> bool:
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()  # the server forks a child that finds an empty request and exits
    return True


def stop(path: Path) -> None:
    """Stop the server (removing its socket ends its loop at the next run; the signal now)."""
    path.unlink(missing_ok=True)
    pid_file = Path(f"{path}.pid")
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
