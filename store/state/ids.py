"""Unguessable 63-bit ids for leases and sessions, drawn from the OS's CSPRNG in blocks.

Why blocks: a lease id is drawn per leased lookup and per allocation, on the engine's hot
path, and one ``getrandom`` system call costs ~10 µs on a VM (``secrets.randbits`` makes one
per id); 512 ids per call cost the same and keep every id as unpredictable (a lease or
session id is a capability: whoever knows it may release or renew the lease).

Not thread-safe: the store draws under its lock.
"""

from __future__ import annotations

import os

_BLOCK_IDS = 512


class RandomIds:
    def __init__(self) -> None:
        self._block = b""
        self._at = 0

    def draw(self) -> int:
        """A random id in [1, 2**63)."""
        while True:
            if self._at >= len(self._block):
                self._block, self._at = os.urandom(8 * _BLOCK_IDS), 0
            value = int.from_bytes(self._block[self._at : self._at + 8], "little") >> 1
            self._at += 8
            if value:
                return value
