"""A short demonstration client: put chunks into a store's pool and read them back.

Run by ``kvtier demo`` in a second process, so the bytes really go through shared memory
between processes; also usable alone with ``kvtier store demo --address HOST:PORT``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api import StoreAdmin
from kvtier.store.client.shm import page_aligned_empty
from kvtier.tiers import connect

DEMO_NAMESPACE = Namespace(
    model="kvtier-demo", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_size=128
)


@dataclass
class DemoReport:
    chunks: int
    chunk_bytes: int
    put_s: float
    get_s: float
    repeat_put_existed: int
    verified: bool
    store_chunks: int

    def lines(self) -> list[str]:
        total = self.chunks * self.chunk_bytes
        return [
            f"put {self.chunks} chunks x {self.chunk_bytes >> 10} KiB: "
            f"{self.put_s * 1e3:.1f} ms ({total / self.put_s / 1e9:.2f} GB/s)",
            f"get the same prefix back:  {self.get_s * 1e3:.1f} ms "
            f"({total / self.get_s / 1e9:.2f} GB/s), bytes identical: {self.verified}",
            f"put again: {self.repeat_put_existed} chunks already stored (idempotent, no copy)",
            f"store now holds {self.store_chunks} chunks",
        ]


def run_demo(address: str | None, chunks: int = 64, seed: int = 0) -> DemoReport:
    ns = DEMO_NAMESPACE
    # bytes per token = layers x (K and V) x heads x head size x 2 bytes (bf16)
    chunk_bytes = ns.num_layers * 2 * ns.num_kv_heads * ns.head_size * 2 * ns.chunk_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, size=chunks * ns.chunk_tokens, dtype=np.uint32)
    keys = prompt_keys(ns, tokens)
    data = [rng.integers(0, 256, size=chunk_bytes, dtype=np.uint8) for _ in keys]
    config = StoreConfig(address=address) if address else StoreConfig()
    with connect(config) as tier:
        ns_id = tier.register_namespace(ns, chunk_bytes)
        start = time.perf_counter()
        tier.put(ns_id, keys, data)
        put_s = time.perf_counter() - start
        # read back as the connector does: into buffers allocated beforehand
        dst = [page_aligned_empty(chunk_bytes) for _ in keys]
        start = time.perf_counter()
        with tier.read(ns_id, keys) as lease:
            for i in range(len(lease)):
                lease.read_into(i, dst[i])
        get_s = time.perf_counter() - start
        verified = (
            lease.valid is True
            and len(lease) == len(keys)
            and all(np.array_equal(g, d) for g, d in zip(dst, data, strict=True))
        )
        again = tier.put(ns_id, keys, data)
        admin = tier.store  # the demo's own store: both surfaces of its API
        assert isinstance(admin, StoreAdmin)
        stats = admin.stats()
    return DemoReport(
        chunks=len(keys),
        chunk_bytes=chunk_bytes,
        put_s=put_s,
        get_s=get_s,
        repeat_put_existed=again.existed,
        verified=verified,
        store_chunks=int(stats["chunks"]),
    )
