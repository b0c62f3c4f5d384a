"""A store's state machine (``StoreCore``) under test control: a small pool, a fake clock for
lease expiry (no sleeping), a namespace and its keys, chunks put and committed."""

from __future__ import annotations

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import AllocStatus
from kvtier.store.state.core import StoreCore

PAGE = 4096
CHUNK = 3 * PAGE  # three pages per chunk


class FakeClock:
    """Time under test control, for lease expiry (no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_core(
    pages: int = 30, eviction: str = "lru", clock: FakeClock | None = None, event_buffer: int = 1024
) -> StoreCore:
    return StoreCore(
        node_id="n",
        epoch=7,
        capacity_bytes=pages * PAGE,
        page_size=PAGE,
        eviction=eviction,
        lease_ttl_s=5,
        write_ttl_s=5,
        event_buffer=event_buffer,
        clock=clock or FakeClock(),
    )


NS = Namespace(
    model="m", dtype="float16", num_layers=1, num_kv_heads=1, head_size=8, chunk_tokens=4
)


def keys(n: int, start: int = 0) -> list[bytes]:
    return prompt_keys(NS, list(range(start, start + 4 * n)))


def put(core: StoreCore, ns_id: bytes, ks: list[bytes]) -> list[AllocStatus]:
    result = core.allocate(ns_id, ks, [CHUNK] * len(ks))
    if result.lease_id:
        n = sum(s is AllocStatus.ALLOCATED for s in result.statuses)
        core.commit(result.lease_id, None, list(range(1, n + 1)))
    return result.statuses
