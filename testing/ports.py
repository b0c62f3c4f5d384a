"""Free loopback ports for the processes that benchmarks and tests start.

A port found free by binding port 0 comes from the kernel's ephemeral range, which every
outgoing connection on the machine draws from too: between the pick and the child's own bind,
a gRPC, HTTP or ZMQ client can take it (seen: a vLLM engine failing on its KV-event socket with
"Address already in use" in a cluster run). So ports are drawn below that range, where only an
explicit bind can take them; at random, so concurrent processes rarely draw the same one; and
never twice by one process, so two servers it starts never get the same one.
"""

from __future__ import annotations

import functools
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SPAN = 10_000  # ports drawn from [ephemeral start - SPAN, ephemeral start)
LOWEST = 1_024
MIN_SPAN = 1_000  # an ephemeral range starting lower leaves no room: take the kernel's choice

# Ports this process has handed out (module state on purpose: "never twice by one process"
# must hold across every caller in the process; it only grows by a few ports per server).
_given: set[int] = set()


@functools.cache
def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc cannot say)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and no outgoing connection can
    take before the caller binds it (see the module's docstring)."""
    top = ephemeral_start()
    bottom = max(LOWEST, top - SPAN)
    rng = random.SystemRandom()
    for _ in range(200 if top - bottom >= MIN_SPAN else 0):
        port = rng.randrange(bottom, top)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    while True:  # no room or no luck below the range: the kernel's choice, not a repeat
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
