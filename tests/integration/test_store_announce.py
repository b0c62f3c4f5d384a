"""A store started with --index announces itself: the index follows its events without being
told about it, so other nodes can find (and pull) what it holds."""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.tiers import connect

from support.helpers import http_json, start_index_process, start_store_process

NS = Namespace(
    model="announce", dtype="f16", num_layers=1, num_kv_heads=1, head_size=64, chunk_tokens=16
)


def test_store_announces_itself_and_is_followed(run_dir: Path) -> None:
    index = start_index_process()
    store = start_store_process(run_dir, "16MiB", "--index", index.address, node_id="node-x")
    try:
        with connect(StoreConfig(address=store.address)) as tier:
            ns_id = tier.register_namespace(NS, 4096)
            keys = prompt_keys(NS, list(range(16 * 5)))
            tier.put(ns_id, keys, [bytes(4096)] * 5)
        deadline = time.monotonic() + 30
        entries = 0
        while time.monotonic() < deadline:
            _, locations = http_json(f"{index.http}/locations")
            mine = [loc for loc in locations if loc["location"] == "node-x"]
            if mine:
                assert mine[0]["endpoints"]["store"] == store.address
                entries = mine[0]["entries"].get("cpu", 0)
                if entries == 5:
                    break
            time.sleep(0.2)
        assert entries == 5
    finally:
        store.stop()
        index.stop()
