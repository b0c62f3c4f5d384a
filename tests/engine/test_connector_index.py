"""A vLLM with the connector and KV events on announces itself to the index, which then follows
its events: the index knows what the instance holds in GPU memory, with no index config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.core.chunks import Tier
from kvtier.index.api import LocationKind, Query
from kvtier.index.client.grpc import GrpcIndexClient
from kvtier.testing.ports import free_port
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

from support.helpers import start_index_process
from support.vllm_fixtures import make_tiny_llama, vllm_env

pytestmark = pytest.mark.vllm


def test_instance_announces_itself_and_index_learns_its_gpu(tmp_path: Path, run_dir: Path) -> None:
    model = str(make_tiny_llama(tmp_path / "tiny"))
    index = start_index_process()
    try:
        prompt = [random.Random(3).randrange(4, 500) for _ in range(300)]
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "replay_endpoint": f"tcp://*:{free_port()}",
        }
        extra = {"chunk_tokens": 64, "index_address": index.address, "instance_id": "vllm-x"}
        spec = {
            "model": model,
            "kv_events_config": events,
            "kv_transfer_config": kvtier_transfer_config(extra),
            "phases": [
                {"op": "sleep", "seconds": 3},  # the index starts following
                {"op": "generate", "prompts": [prompt], "max_tokens": 2},
                {"op": "sleep", "seconds": 4},
            ],
        }  # ... and catches the events
        run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)))
        client = GrpcIndexClient(index.address)
        (instance,) = [
            info for info in client.locations() if info.registration.location == "vllm-x"
        ]
        assert instance.registration.kind is LocationKind.INSTANCE
        ns_id = instance.registration.namespaces[0]
        held = client.query_one(Query(ns_id, tokens=prompt)).of("vllm-x")
        assert held is not None and held.runs[Tier.GPU] == 300 // 64
        client.close()
    finally:
        index.stop()
