"""Run inside a network namespace by test_remote_netns.py: put chunks into the holder store,
have the puller fetch them across the veth pair, report what the interface counted (JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvtier.core.config import load_config
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.core.rpc import ClientAuth
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.tiers.cpu import CpuTier

# the stores listen on the veth addresses, so they demand a credential: KVTIER_AUTH__TOKEN
AUTH = ClientAuth.from_config(load_config().auth)


def rx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


def main(holder: str, puller: str, interface: str, n: int, size: int) -> None:
    ns = Namespace(model="netns", dtype="u8", num_layers=1, num_kv_heads=1, head_size=size)
    keys = prompt_keys(ns, np.arange(n * ns.chunk_tokens, dtype=np.uint32))
    chunks = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]
    with CpuTier(GrpcStoreClient(holder, auth=AUTH)) as tier:
        ns_id = tier.register_namespace(ns, size)
        tier.put(ns_id, keys, chunks)
    before = rx_bytes(interface)
    with CpuTier(GrpcStoreClient(puller, auth=AUTH)) as tier:
        tier.register_namespace(ns, size)
        result = tier.store.fetch(ns_id, keys, holder)
        got = tier.get(ns_id, keys[: result.local])
    exact = len(got) == n and all(g == c.tobytes() for g, c in zip(got, chunks, strict=True))
    print(
        json.dumps(
            {
                "status": result.status.value,
                "local": result.local,
                "exact": exact,
                "rx_bytes": rx_bytes(interface) - before,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
