"""The disk tier end to end: a real vLLM whose prompts' chunks were evicted from a small DRAM
pool gets exact hits staged from the node store's disk, and so does a fresh vLLM after the
store is killed (``kill -9``) and started again on the same directory. vLLM's own per-source
counters say where the tokens came from (``source=disk``)."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from kvtier.testing.services import disk_env
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

from support.helpers import StoreProcess, start_store_process
from support.vllm_fixtures import make_tiny_llama, vllm_env

pytestmark = pytest.mark.vllm

CHUNK = 64
DISK = "vllm:prompt_tokens_cached_by_source{source=disk}"
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def start_disk_store(run_dir: Path, disk: Path) -> StoreProcess:
    # a 1 MiB pool: let one save fill it
    env = disk_env(disk, KVTIER_STORE__MAX_BATCH_FRACTION="1")
    return start_store_process(run_dir, "1MiB", env=env)


def run(model: str, phases: list[dict], run_dir: Path, store: StoreProcess) -> list:
    extra = {
        "chunk_tokens": CHUNK,
        "min_hit_tokens": {"cpu": CHUNK, "disk": CHUNK},
        "store_address": store.address,
        "tiers": ["cpu", "disk"],
    }
    spec = {"model": model, "phases": phases, "kv_transfer_config": kvtier_transfer_config(extra)}
    return run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]


def assert_exact(reference: list[dict], got: list[dict]) -> None:
    for ref, out in zip(reference, got, strict=True):
        assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"]


def test_evicted_chunks_hit_from_disk_before_and_after_a_store_crash(
    tiny_model: str, run_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    batch = prompts(21, [400, 300])  # 6 + 4 chunks
    others = prompts(22, [512, 512, 512])  # 24 chunks: more than the pool holds
    store = start_disk_store(run_dir, disk)
    try:
        reference, _, _, _, _, _, evicted, metrics = run(
            tiny_model,
            [
                {"op": "generate", "prompts": batch, "prompt_logprobs": True},
                {"op": "settle"},
                {"op": "sleep", "seconds": 1.0},  # the store copies them to disk
                {"op": "generate", "prompts": others},  # evicts them from DRAM
                {"op": "settle"},
                {"op": "reset_prefix_cache"},
                {"op": "generate", "prompts": batch},
                {"op": "metrics"},
            ],
            run_dir,
            store,
        )
        assert_exact(reference, evicted)
        assert [r["num_cached_tokens"] for r in evicted] == [384, 256]
        assert metrics[DISK] == 384 + 256
        assert metrics["vllm:kvtier_disk_staged_chunks"] >= 6 + 4
        store.proc.send_signal(signal.SIGKILL)
        store.proc.wait(timeout=30)
    finally:
        store.stop()
    again = start_disk_store(run_dir, disk)
    try:
        after, metrics = run(
            tiny_model,
            [{"op": "generate", "prompts": batch}, {"op": "metrics"}],
            run_dir,
            again,
        )
        assert_exact(reference, after)
        assert [r["num_cached_tokens"] for r in after] == [384, 256]
        assert metrics[DISK] == 384 + 256 and metrics[HOST] == 0
    finally:
        again.stop()
