"""Free ports for the processes tests and benchmarks start: below the ephemeral range (no
outgoing connection can take them before the child binds), never twice per process."""

from __future__ import annotations

import socket

from kvtier.testing.ports import MIN_SPAN, ephemeral_start, free_port


def test_ports_are_bindable_distinct_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    if ephemeral_start() - 1024 >= MIN_SPAN:  # room below the ephemeral range (Linux: 32768)
        assert all(1024 <= p < ephemeral_start() for p in ports)
    with socket.socket() as sock:  # free when handed out (nothing else here binds them)
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_never_handed_out() -> None:
    """Hold 300 ports of the 10,000 it draws from (2 % of them): 300 draws that did not check
    would hit one with probability 1 - 0.98^300 > 99.7 %."""
    top = max(ephemeral_start(), 1024 + 10_000)  # where it draws from, or the kernel does
    listeners = []
    try:
        for port in range(top - 10_000, top, 33):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            listeners.append(sock)
        held = {s.getsockname()[1] for s in listeners}
        assert len(held) > 250
        assert not held & {free_port() for _ in range(300)}
    finally:
        for sock in listeners:
            sock.close()
