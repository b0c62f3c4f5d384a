"""vLLM pieces shared by tests: a tiny random model, an in-process engine, and a KV-event
publisher that can inject the faults a healthy engine never shows on demand.

- ``make_tiny_llama(path)``: a 2-layer random Llama + offline tokenizer (~2 MB, ~5 s), and
  ``vllm_env()``: the environment vLLM runs in (both from ``kvtier.testing.models``).
- ``tiny_llm(model, **overrides)``: ``vllm.LLM`` in this process with settings that work on
  the CPU build (see /work/notes/vllm.md §6); set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` first.
- ``FaultyPublisher``: vLLM's wire format (PUB ``[topic, seq, payload]`` + ROUTER replay),
  payloads encoded by vLLM's own ``KVEventBatch`` when vLLM is importable, able to drop
  batches on the live socket, forget them from the replay buffer, or send garbage.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvtier.testing.models import VLLM_ENV, make_tiny_llama, vllm_env

__all__ = ["VLLM_ENV", "FaultyPublisher", "make_tiny_llama", "tiny_llm", "vllm_env", "wait_for"]


def tiny_llm(model: str | Path, **overrides: Any):  # -> vllm.LLM
    """An in-process engine on the tiny model (call with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    args: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": 32,  # CPU attention: a multiple of 32
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "seed": 0,
        "kv_cache_memory_bytes": 64 << 20,
        "disable_log_stats": True,
    }
    args.update(overrides)
    return LLM(**args)


# -- a publisher for fault injection ----------------------------------------------------------

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_payload(events: list[Any], ts: float | None = None) -> bytes:
    """A batch payload exactly as vLLM encodes it (its own classes when importable)."""
    ts = time.time() if ts is None else ts
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError:  # the index's mirror (same bytes)
        return msgspec.msgpack.encode([ts, events, 0])
    return msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=ts, events=events, data_parallel_rank=0)
    )


class FaultyPublisher:
    """vLLM's ZMQ KV-event publisher (PUB + ROUTER replay), with faults on request.

    ``publish(events)`` sends the next batch; ``drop_live`` / ``forget`` make that batch
    skip the live socket / the replay buffer. ``send_raw`` sends any frames. Thread-safe
    enough for tests: replay is served by a thread while the test publishes.
    """

    def __init__(self, port: int, replay_port: int | None, topic: str = "kv", buffer: int = 1000):
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self.replays = 0
        self._thread = None
        if replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(
        self,
        events: list[Any],
        drop_live: bool = False,
        forget: bool = False,
        ts: float | None = None,
    ) -> int:
        payload = encode_payload(events, ts)
        with self._lock:
            seq = self.seq
            self.seq += 1
            if not forget:
                self.buffer.append((seq, payload))
        if not drop_live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._halt.is_set():
            if not poller.poll(50):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= start_seq]
            for s, p in batches:
                self._router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._router.close(linger=0)
        self.pub.close(linger=0)
        self._ctx.term()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = ""):
    """Poll until ``predicate()`` is truthy; returns its value or fails with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)
