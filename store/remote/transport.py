"""The data plane of the remote tier: reading byte ranges of a peer's pool into our own.

A ``Transport`` registers this store's pool so peers can read it, publishes the address peers
reach it at, and reads batches of (local offset, remote offset, length) triples from a peer's
pool into ours before a deadline. Offsets are relative to the pools; the transport turns them
into whatever its engine wants (Mooncake: virtual addresses in each process).

Threading: implementations are thread-safe; several reads may run at once.
Ownership: a read writes only the local ranges it was given. When a read does not end OK, the
local ranges of ops not reported ``done`` may *still be written* for up to
``late_write_window_s`` (the engine may deliver bytes after giving up): the caller must not
reuse those pages before then (the store quarantines them).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.chunks import Extent


class TransferStatus(enum.StrEnum):
    OK = "ok"  # every op's bytes landed
    PEER_UNREACHABLE = "peer_unreachable"  # refused / no such peer / probe failed
    TIMEOUT = "timeout"  # the deadline passed with ops in flight (peer stalled or slow)
    FAILED = "failed"  # the engine reported a failure (peer died mid-transfer, bad range)


@dataclass(frozen=True, slots=True)
class ReadOp:
    local_offset: int
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PeerPool:
    """Where a peer's pool is: its transport address, and (for engines addressing remote
    memory by virtual address) the pool's base address in the peer's process."""

    address: str
    base: int
    size: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    status: TransferStatus
    done: tuple[bool, ...]  # per op: its bytes landed completely (only these may be trusted)
    submitted: int = 0  # ops [0, submitted) were handed to the engine; the rest never started
    message: str = ""


class Transport(abc.ABC):
    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this transport (published as ``StoreInfo.transfer_address``)."""

    @property
    @abc.abstractmethod
    def late_write_window_s(self) -> float:
        """After a read that did not end OK, how long its unfinished ops may still write."""

    @abc.abstractmethod
    def register_pool(self, base: int, size: int) -> None:
        """Make ``size`` bytes at virtual address ``base`` readable by peers, and the target
        of local reads (one pool per transport)."""

    @abc.abstractmethod
    def read(
        self,
        peer: PeerPool,
        ops: Sequence[ReadOp],
        timeout_s: float,
        on_done: Callable[[int], None] | None = None,
    ) -> ReadResult:
        """Read every op from ``peer``'s pool into ours, in one batch, within ``timeout_s``.

        ``on_done(i)`` is called in the calling thread as soon as op i's bytes have landed,
        while later ops are still in flight (so the caller can verify chunk by chunk).
        Never raises for peer failures: they are statuses."""

    @abc.abstractmethod
    def probe(self, address: str, timeout_s: float) -> TransferStatus:
        """Is the peer at ``address`` alive and answering? Bounded by ``timeout_s``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister the pool and stop serving peers (in-flight peer reads then fail)."""


class RangeError(ValueError):
    """A range outside a pool: refused before anything is submitted."""


def plan_ops(
    local: Sequence[Extent], remote: Sequence[Extent], local_size: int, remote_size: int
) -> list[ReadOp]:
    """The ops that copy one chunk laid out as ``remote`` extents into ``local`` extents.

    Both lists cover the same number of bytes but may be cut differently (pages are allocated
    independently on each side); the ops are their common refinement, in chunk order. Every
    range is checked against its pool first: an engine told to read outside a registered
    buffer rejects it, but drops the connection too, which stalls the next read ~1 s.
    """
    for off, length in local:
        _check(off, length, local_size, "local")
    for off, length in remote:
        _check(off, length, remote_size, "remote")
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise RangeError(
            f"chunk sizes differ: {sum(n for _, n in local)} bytes here, "
            f"{sum(n for _, n in remote)} at the peer"
        )
    ops: list[ReadOp] = []
    li = ri = 0
    lpos = rpos = 0  # bytes consumed of the current local / remote extent
    while li < len(local) and ri < len(remote):
        loff, llen = local[li]
        roff, rlen = remote[ri]
        n = min(llen - lpos, rlen - rpos)
        if n:
            last = ops[-1] if ops else None
            if (
                last is not None
                and last.local_offset + last.length == loff + lpos
                and last.remote_offset + last.length == roff + rpos
            ):
                ops[-1] = ReadOp(last.local_offset, last.remote_offset, last.length + n)
            else:
                ops.append(ReadOp(loff + lpos, roff + rpos, n))
        lpos += n
        rpos += n
        if lpos == llen:
            li, lpos = li + 1, 0
        if rpos == rlen:
            ri, rpos = ri + 1, 0
    return ops


def split_ops(ops: Sequence[ReadOp], max_bytes: int) -> list[ReadOp]:
    """The same bytes, in the same order, as ops of at most ``max_bytes``."""
    out: list[ReadOp] = []
    for op in ops:
        for start in range(0, op.length, max_bytes):
            n = min(max_bytes, op.length - start)
            out.append(ReadOp(op.local_offset + start, op.remote_offset + start, n))
    return out


def _check(offset: int, length: int, size: int, side: str) -> None:
    if offset < 0 or length <= 0 or offset + length > size:
        raise RangeError(f"{side} range ({offset}, {length}) is outside the {size}-byte pool")
