"""``Transport`` over the Mooncake transfer engine (``mooncake-transfer-engine``).

One engine per store: it serves peers' reads of our registered pool and reads theirs. The
engine's behaviour that shapes this module (measured in docs/remote.md and the team's notes):

- Settings come from ``MC_*`` environment variables read when the engine is built; they are
  written here from ``RemoteConfig`` (``engine_environment``), never set by hand.
- ``transfer_sync_*`` and ``get_batch_transfer_status`` busy-wait a core each. Reads here are
  submitted asynchronously, one single-entry batch per op (``transfer_check_status`` only
  reports a batch's first task, so this is the only way to know exactly which ops landed), all
  before waiting for any, then polled with short sleeps.
- A failed or abandoned op may keep writing its destination for a while (a batch whose first
  op fails returns while the others still stream in; a timed-out request lives on in the I/O
  thread until its TCP progress timeout). ``late_write_window_s`` tells the caller how long.
- First contact with a peer that is alive but frozen blocks ~61 s (hard-coded handshake
  timeout), holding the engine's mutex. A peer is therefore probed (``send_probe``, which
  blocks only its own thread) before first contact and after any failure, under our deadline.
- An out-of-range read is rejected but costs a reconnect; ranges are checked before submit.
- Every start logs ``E… transfer_metadata.cpp:…] Local segment descriptor not found``, which is
  not an error: the transport asks for its own segment descriptor (to extend one another
  transport made) before creating it, and in P2P-handshake mode that lookup logs when there is
  none. While the engine initialises, stderr passes through a filter that drops that line and
  glog's "Logging before InitGoogleLogging()" notice, and nothing else (``_stderr_without``).

The package is imported lazily, so a store without the remote tier never needs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvtier.core.config.store import RemoteConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.remote.transport import PeerPool, ReadOp, ReadResult, TransferStatus, Transport

log = logging.getLogger(__name__)

# The engine reads its environment at construction; builds are serialised so two stores in one
# process (tests, benchmarks) each get their own settings.
_ENGINE_BUILD_LOCK = threading.Lock()

POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
PR_SET_TIMERSLACK = 29
JANITOR_PERIOD_S = 0.1
ERR_SOCKET = -102


def engine_environment(config: RemoteConfig) -> dict[str, str | None]:
    """The ``MC_*`` variables for ``config`` (None = remove). Why each one:

    - MC_FORCE_TCP: the engine picks RDMA whenever it finds an HCA, whatever ``protocol`` says;
      forcing TCP keeps a CI or loopback setup from switching transports silently.
    - MC_TRANSFER_TIMEOUT: the engine's own per-transfer deadline (seconds, minimum 5).
    - MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC: below MC_TRANSFER_TIMEOUT, so a
      stalled socket is torn down before the engine reports the transfer failed; otherwise the
      request stays alive and its bytes land later (measured: 64 MiB after a reported failure).
    - MC_MIN_RPC_PORT / MC_MAX_RPC_PORT: the two listening ports (handshake, data) come from
      this range, so a firewall rule can cover them.
    - MC_LOG_LEVEL: glog's own GLOG_minloglevel is overridden by the engine; at INFO it logs a
      line per batch.
    """
    return {
        "MC_FORCE_TCP": "1" if config.protocol == "tcp" else None,
        "MC_TRANSFER_TIMEOUT": str(config.transfer_timeout_s),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(config.tcp_progress_timeout_s),
        "MC_TCP_STATUS_TIMEOUT_SEC": str(config.tcp_progress_timeout_s),
        "MC_MIN_RPC_PORT": str(config.min_port),
        "MC_MAX_RPC_PORT": str(config.max_port),
        "MC_LOG_LEVEL": config.log_level,
    }


def apply_environment(env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


_thread_state = threading.local()


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps be short: Linux rounds a sleep up by the thread's timer
    slack (50 µs by default), which would double the latency of a 64 KiB read."""
    if getattr(_thread_state, "slack_set", False):
        return
    _thread_state.slack_set = True
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 µs


# What the engine writes to stderr on every start that is not trouble (see the module's notes).
# Dropped only while it initialises: the same descriptor message later (a peer handshaking
# before our segment exists) is a real error and passes.
BENIGN_START_LINES = (
    "] Local segment descriptor not found",
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
)


@contextlib.contextmanager
def _stderr_without(lines: Sequence[str]) -> Iterator[None]:
    """File descriptor 2 through ``grep -v`` for the duration: lines containing any of ``lines``
    are dropped, every other line (the engine's real errors, other threads' output) passes in
    order as it is written. A separate process, so what was written before a crash still comes
    out, and a chatty engine never blocks on a full pipe. Without grep or a stderr, a no-op."""
    grep = shutil.which("grep")
    try:
        saved = os.dup(2) if grep else -1
    except OSError:
        saved = -1
    if saved < 0:
        yield
        return
    argv = [str(grep), "-v", "-F", "--line-buffered"]
    for line in lines:
        argv += ["-e", line]
    try:
        filt = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=saved, stderr=saved)
    except OSError:
        os.close(saved)
        yield
        return
    assert filt.stdin is not None
    sys.stderr.flush()
    os.dup2(filt.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        filt.stdin.close()
        # Out before anything this process writes next; a child started meanwhile may hold the
        # pipe open: then the filter serves it until it exits.
        with contextlib.suppress(subprocess.TimeoutExpired):
            filt.wait(5)


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise KvtierError(
            ErrorCode.UNAVAILABLE,
            "the remote tier needs the Mooncake transfer engine: "
            f"pip install 'kvtier[remote]' ({exc})",
        ) from None
    return TransferEngine


class MooncakeTransport(Transport):
    """Thread-safe. ``segment_name`` names this engine in a metadata service (http/etcd modes;
    P2P mode names it by its handshake port)."""

    def __init__(self, config: RemoteConfig, segment_name: str = "") -> None:
        self.config = config
        with _ENGINE_BUILD_LOCK:
            apply_environment(engine_environment(config))
            engine_cls = _import_engine()
            self._engine = engine_cls()
            p2p = config.metadata == "P2PHANDSHAKE"
            local = config.hostname if p2p else (segment_name or f"{config.hostname}:{os.getpid()}")
            with _stderr_without(BENIGN_START_LINES):
                rc = self._engine.initialize(
                    local, config.metadata, config.protocol, config.device_name
                )
        if rc != 0:
            raise KvtierError(
                ErrorCode.UNAVAILABLE,
                f"transfer engine failed to start ({config.protocol}, metadata "
                f"{config.metadata!r}, host {config.hostname!r}): rc {rc}",
            )
        self._address = f"{config.hostname}:{self._engine.get_rpc_port()}" if p2p else local
        self._base = 0
        self._size = 0
        self._lock = threading.Lock()
        self._healthy: set[str] = set()  # peers contacted successfully since their last failure
        self._probes: dict[str, Future[int]] = {}
        self._probe_threads: list[threading.Thread] = []
        self._abandoned: list[tuple[int, float]] = []  # (batch id, abandoned at)
        self.inflight_ops = 0
        self.leaked_batches = 0
        self._closed = threading.Event()
        self._janitor = threading.Thread(
            target=self._janitor_loop, name="kvtier-te-janitor", daemon=True
        )
        self._janitor.start()

    # -- Transport ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def late_write_window_s(self) -> float:
        # A request outlives our deadline at most until the engine's own deadline (plus 1 ns
        # per byte, which the caller's quarantine margin covers).
        return float(self.config.transfer_timeout_s)

    def register_pool(self, base: int, size: int) -> None:
        if self._size:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "a pool is already registered")
        rc = self._engine.register_memory(base, size)
        if rc != 0:
            raise KvtierError(ErrorCode.INTERNAL, f"register_memory({size} bytes) failed: {rc}")
        self._base, self._size = base, size

    def read(
        self,
        peer: PeerPool,
        ops: Sequence[ReadOp],
        timeout_s: float,
        on_done: Callable[[int], None] | None = None,
    ) -> ReadResult:
        deadline = time.monotonic() + timeout_s
        done = [False] * len(ops)
        if not ops:
            return ReadResult(TransferStatus.OK, ())
        if not self._size:
            raise KvtierError(ErrorCode.INVALID_ARGUMENT, "register the local pool first")
        for op in ops:  # the caller plans ops with plan_ops; this is the last line of defence
            if op.local_offset + op.length > self._size or op.remote_offset + op.length > peer.size:
                raise KvtierError(ErrorCode.INVALID_ARGUMENT, f"op {op} outside a pool")
        _fine_timer_slack()
        status, message = self._contact(peer.address, deadline)
        if status is not TransferStatus.OK:
            return ReadResult(status, tuple(done), 0, message)

        engine = self._engine
        pending: dict[int, int] = {}  # op index -> batch id
        failure: tuple[TransferStatus, str] | None = None
        for i, op in enumerate(ops):
            bid = engine.batch_transfer_async_read(
                peer.address,
                [self._base + op.local_offset],
                [peer.base + op.remote_offset],
                [op.length],
            )
            if bid == 0:  # handshake / segment open failed: nothing of this op was sent
                failure = (TransferStatus.PEER_UNREACHABLE, f"cannot open peer {peer.address}")
                break
            pending[i] = bid
        submitted = len(pending)
        with self._lock:
            self.inflight_ops += submitted
        try:
            nap = POLL_MIN_S
            while pending:
                progressed = False
                for i, bid in list(pending.items()):
                    st = engine.transfer_check_status(bid)  # 1 ok, 0 pending, -1 failed, -2 t/o
                    if st == 0:
                        continue
                    progressed = True
                    del pending[i]
                    if st == 1:
                        done[i] = True
                        if on_done is not None:
                            try:
                                on_done(i)
                            except Exception:  # the caller's bug must not strand the batch
                                log.exception("on_done callback failed")
                    elif st == -2:  # timed out inside the engine; the batch is not freed
                        self._abandon(bid)
                        failure = failure or (TransferStatus.TIMEOUT, "engine transfer timeout")
                    else:
                        failure = failure or (
                            TransferStatus.FAILED,
                            f"transfer from {peer.address} failed (peer died or refused)",
                        )
                if not pending:
                    break
                if time.monotonic() >= deadline:
                    for bid in pending.values():
                        self._abandon(bid)
                    failure = (
                        TransferStatus.TIMEOUT,
                        f"{len(pending)} of {len(ops)} ops from {peer.address} still in "
                        f"flight after {timeout_s:.3g} s",
                    )
                    break
                nap = POLL_MIN_S if progressed else min(nap * 2, POLL_MAX_S)
                time.sleep(nap)
        finally:
            with self._lock:
                self.inflight_ops -= submitted
        if failure is None:
            return ReadResult(TransferStatus.OK, tuple(done), submitted)
        with self._lock:
            self._healthy.discard(peer.address)  # re-probe before the next contact
        return ReadResult(failure[0], tuple(done), submitted, failure[1])

    def probe(self, address: str, timeout_s: float) -> TransferStatus:
        with self._lock:
            self._healthy.discard(address)
        return self._contact(address, time.monotonic() + timeout_s)[0]

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._size:
            self._engine.unregister_memory(self._base)
        self._janitor.join(timeout=1.0)
        if any(t.is_alive() for t in self._probe_threads):
            # A probe of a frozen peer is still inside the engine: destroying it now would
            # pull the engine from under that thread. The process exit reclaims it.
            log.warning("transfer engine left running: a peer probe is still blocked")
            return
        engine, self._engine = self._engine, None
        del engine  # the destructor stops the engine's threads (~0.5 s)

    # -- internals ---------------------------------------------------------------------------

    def _contact(self, address: str, deadline: float) -> tuple[TransferStatus, str]:
        """OK once ``address`` answered a probe since its last failure."""
        with self._lock:
            if address in self._healthy:
                return TransferStatus.OK, ""
            future = self._probes.get(address)
            if future is None or (future.done() and future.result() != 0):
                future = Future()
                self._probes[address] = future
                thread = threading.Thread(
                    target=self._probe_thread,
                    args=(address, future),
                    name="kvtier-te-probe",
                    daemon=True,
                )
                self._probe_threads = [t for t in self._probe_threads if t.is_alive()]
                self._probe_threads.append(thread)
                thread.start()
        wait = max(0.0, min(deadline - time.monotonic(), self.config.probe_timeout_s))
        try:
            rc = future.result(timeout=wait)
        except FutureTimeout:
            return (
                TransferStatus.TIMEOUT,
                f"peer {address} did not answer a probe within {wait:.3g} s (stalled?)",
            )
        with self._lock:
            if self._probes.get(address) is future:
                del self._probes[address]
            if rc == 0:
                self._healthy.add(address)
        if rc == 0:
            return TransferStatus.OK, ""
        return TransferStatus.PEER_UNREACHABLE, f"peer {address} unreachable (probe rc {rc})"

    def _probe_thread(self, address: str, future: Future[int]) -> None:
        try:
            rc = self._engine.send_probe(address)
        except Exception as exc:  # pragma: no cover - binding error
            log.warning("probe of %s raised %r", address, exc)
            rc = ERR_SOCKET
        future.set_result(rc)

    def _abandon(self, bid: int) -> None:
        with self._lock:
            self._abandoned.append((bid, time.monotonic()))

    def _janitor_loop(self) -> None:
        """Keep polling abandoned batches so the engine frees them once they end."""
        max_age = self.config.transfer_timeout_s + 30.0
        while not self._closed.wait(JANITOR_PERIOD_S):
            with self._lock:
                batches, self._abandoned = self._abandoned, []
            keep = []
            for bid, since in batches:
                st = self._engine.transfer_check_status(bid)
                if st in (1, -1):
                    continue  # freed by the engine
                if time.monotonic() - since > max_age:
                    self.leaked_batches += 1  # never ended: its descriptor stays allocated
                    continue
                keep.append((bid, since))
            with self._lock:
                self._abandoned.extend(keep)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._closed.set()
