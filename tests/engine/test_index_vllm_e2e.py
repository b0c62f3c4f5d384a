"""End to end: a real vLLM engine (CPU build, tiny random model, in-process) publishes KV
events; a ``kvtier index serve`` process started after it catches up and follows it."""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.chunks import Tier
from kvtier.core.keys import Namespace, prompt_keys
from kvtier.index.api import Query
from kvtier.index.client.grpc import GrpcIndexClient

from support.helpers import IndexProcess, free_port, start_index_process
from support.vllm_fixtures import make_tiny_llama, tiny_llm, wait_for

pytestmark = pytest.mark.vllm

BLOCK = 32  # the CPU attention backend wants multiples of 32
NS = Namespace(
    model="tiny-llama", dtype="float32", num_layers=2, num_kv_heads=2, head_size=32,
    chunk_tokens=2 * BLOCK,
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def engine(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, dict]]:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's block hashes depend on PYTHONHASHSEED when it is set; ours must not
    monkeypatch.setenv("PYTHONHASHSEED", str(random.randrange(1, 1 << 31)))
    port, replay = free_port(), free_port()
    llm = tiny_llm(
        tiny_model,
        block_size=BLOCK,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kvtier",
        },
    )
    source = {
        "instance": "tiny-0",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kvtier",
        "namespaces": [NS.model_dump()],
        "node": "this-node",
    }
    try:
        yield llm, source
    finally:
        del llm
        gc.collect()


def generate(llm, tokens: list[int]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)


def gpu_run(client: GrpcIndexClient, tokens: list[int]) -> int:
    holding = client.query_one(Query(NS.root_key(), tokens=tokens)).of("tiny-0")
    return holding.runs.get(Tier.GPU, 0) if holding else 0


def test_engine_events_reach_the_index(engine) -> None:
    llm, source = engine
    rng = random.Random(7)
    first = [rng.randrange(4, 500) for _ in range(200)]  # 3 full chunks + 8 tokens
    generate(llm, first)  # before the index exists
    index: IndexProcess = start_index_process(
        "--vllm", json.dumps(source), "--probe-interval", "0.3"
    )
    client = GrpcIndexClient(index.address)
    try:
        wait_for(lambda: gpu_run(client, first) == 3, timeout=20, what="catch-up from the engine")
        # the answer is in canonical keys, computed here from the token ids alone
        by_keys = client.query_one(Query(NS.root_key(), keys=prompt_keys(NS, first)))
        (holding,) = by_keys.holdings
        assert (holding.location, holding.node, dict(holding.runs)) == (
            "tiny-0",
            "this-node",
            {Tier.GPU: 3},
        )
        second = first[:130] + [rng.randrange(4, 500) for _ in range(70)]  # shares 2 chunks
        generate(llm, second)
        wait_for(lambda: gpu_run(client, second) == 3, timeout=20, what="a live request")
        assert gpu_run(client, first) == 3
        assert llm.reset_prefix_cache()
        generate(llm, [rng.randrange(4, 500) for _ in range(20)])  # publishes the clear
        wait_for(
            lambda: gpu_run(client, first) == 0 and gpu_run(client, second) == 0,
            timeout=20,
            what="reset_prefix_cache",
        )
        (stats,) = client.stats()["sources"]
        assert stats["events"]["AllBlocksCleared"] == 1
        assert stats["gaps_lost"] == 0 and stats["state"] == "live"
        assert stats["restarts"] == 0
    finally:
        client.close()
        assert index.stop() == 0
