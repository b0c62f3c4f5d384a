"""The transfer engine's start-up on stderr: its one benign ERROR line ("Local segment
descriptor not found": the transport looks up its own segment before creating it) is dropped,
and a real start-up error still reaches stderr."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.remote

START = """
import sys
from kvtier.core.config.store import RemoteConfig
from kvtier.store.remote.mooncake import MooncakeTransport
ports = [int(p) for p in sys.argv[1:]]
config = RemoteConfig(enabled=True, **(dict(min_port=ports[0], max_port=ports[0]) if ports else {}))
transport = MooncakeTransport(config)
print("started", transport.address, flush=True)
transport.close()
"""


def _start(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", START, *args], capture_output=True, text=True, timeout=60
    )


def test_benign_start_line_is_dropped() -> None:
    result = _start()
    assert result.returncode == 0, result.stderr
    assert "started 127.0.0.1:" in result.stdout
    assert "Local segment descriptor not found" not in result.stderr, result.stderr
    assert "InitGoogleLogging" not in result.stderr, result.stderr


def test_real_start_error_still_shows() -> None:
    with socket.socket() as held:  # the engine's only allowed port is taken
        for port in range(16990, 17000):  # inside 15000-17000: the engine may reset others
            try:
                held.bind(("0.0.0.0", port))
                break
            except OSError:
                continue
        else:
            pytest.skip("no free port to hold")
        held.listen()
        result = _start(str(port))
    assert result.returncode != 0
    assert "No valid port found" in result.stderr, result.stderr
    assert "transfer engine failed to start" in result.stderr
