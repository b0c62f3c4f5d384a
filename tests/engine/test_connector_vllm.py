"""The connector inside a real vLLM (CPU build, tiny random model): exact hits, sharing,
attribution, bad configs. Each vLLM instance runs in its own process (kvtier.testing.vllm_driver).
Failure paths are drilled in test_fault_drills.py."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from kvtier.connector.config import parse_extra_config
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

from support.helpers import StoreProcess, start_store_process, vllm_start_failure
from support.vllm_fixtures import make_tiny_llama, vllm_env

pytestmark = pytest.mark.vllm

CHUNK = 64  # tokens; two vLLM blocks of 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def run(model: str, phases: list[dict], run_dir: Path, extra: dict | None = None) -> list:
    """One vLLM instance with kvtier, in its own process."""
    extra = {"chunk_tokens": CHUNK, "min_hit_tokens": {"cpu": CHUNK}} | (extra or {})
    spec = {"model": model, "phases": phases, "kv_transfer_config": kvtier_transfer_config(extra)}
    return run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)))


def start_failure(model: str, run_dir: Path, extra: dict) -> tuple[int, str]:
    """Start vLLM with a connector config expected to be refused; (exit code, stderr)."""
    extra = {"chunk_tokens": CHUNK} | extra
    spec = {"model": model, "phases": [], "kv_transfer_config": kvtier_transfer_config(extra)}
    return vllm_start_failure(spec, run_dir)


def prompts(seed: int, lengths: list[int], shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(4, 500) for _ in range(n - shared_prefix)] for n in lengths]


def assert_same_outputs(reference: list[dict], got: list[dict]) -> None:
    for ref, out in zip(reference, got, strict=True):
        assert out["tokens"] == ref["tokens"]
        assert out["logprobs"] == ref["logprobs"]  # bit-exact, not approximately


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
DEVICE = "vllm:prompt_tokens_cached_by_source{source=device}"


def test_embedded_dram_hits_are_exact_and_attributed(tiny_model: str, run_dir: Path) -> None:
    """One vLLM, no store configured: an embedded store gives DRAM hits after vLLM's own
    prefix cache is reset, with exactly the logprobs of a recompute; metrics say where
    each token came from."""
    # 300: 4 chunks + a partial one; 512: exactly 8 chunks (a full-prompt hit); 40: no chunk;
    # two prompts sharing 200 tokens.
    batch = prompts(1, [300, 512, 40]) + prompts(2, [260, 330], shared_prefix=200)
    # whole chunks, but never the prompt's last block (as vLLM's own cache): 512 -> 480
    expected_hits = [256, 480, 0, 256, 320]
    results = run(
        tiny_model,
        [
            {"op": "generate", "prompts": batch, "prompt_logprobs": True},  # recompute + save
            {"op": "metrics"},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": batch},  # DRAM hits
            {"op": "metrics"},
            {"op": "generate", "prompts": batch},  # vLLM's own (GPU) hits now
            {"op": "metrics"},
            # prompt logprobs past the cached prefix, read through the cache
            {"op": "reset_prefix_cache"},
            {
                "op": "generate",
                "prompts": batch,
                "prompt_logprobs": True,
                "skip_reading_prefix_cache": False,
            },
        ],
        run_dir,
    )
    reference, m0, _, dram, m1, gpu, m2, _, dram_prompt_lp = results
    assert_same_outputs(reference, dram)
    assert_same_outputs(reference, gpu)
    assert [r["num_cached_tokens"] for r in dram] == expected_hits
    # Requests run one after the other, so the last one finds the 192 tokens (6 blocks) it
    # shares with the one before in vLLM's own cache, and only the rest in DRAM.
    assert delta(m1, m0, DEVICE) == 192
    assert delta(m1, m0, HOST) == sum(expected_hits) - 192
    assert delta(m1, m0, "vllm:kvtier_cpu_hit_tokens") == sum(expected_hits) - 192
    assert delta(m1, m0, "vllm:kvtier_load_error_blocks") == 0
    assert delta(m2, m1, HOST) == 0  # the third pass hit vLLM's own cache
    assert delta(m2, m1, DEVICE) > 0
    # 300, 512, 40, 260, 330 tokens: 4 + 8 + 0 + 4 chunks, and the 330-token prompt adds 2:
    # its first 3 chunks are the 260-token one's (the store says EXISTS, no second copy)
    assert m0["vllm:kvtier_committed_chunks"] == 4 + 8 + 4 + 2
    assert m0["vllm:kvtier_save_exists"] == 3
    for ref, out in zip(reference, dram_prompt_lp, strict=True):
        cached = out["num_cached_tokens"]
        assert out["prompt_logprobs"][cached + 1 :] == ref["prompt_logprobs"][cached + 1 :]


def test_second_instance_hits_what_the_first_stored(tiny_model: str, run_dir: Path) -> None:
    """Two vLLM instances on one node store: the second gets DRAM hits for the first's
    prompts, exact."""
    store: StoreProcess = start_store_process(run_dir, "256MiB")
    try:
        extra = {"store_address": store.address}
        batch = prompts(3, [400, 200])
        first = run(
            tiny_model,
            [{"op": "generate", "prompts": batch, "prompt_logprobs": True}],
            run_dir,
            extra,
        )[0]
        second, metrics = run(
            tiny_model, [{"op": "generate", "prompts": batch}, {"op": "metrics"}], run_dir, extra
        )
        assert_same_outputs(first, second)
        assert [r["num_cached_tokens"] for r in second] == [384, 192]
        assert metrics[HOST] == 384 + 192
    finally:
        store.stop()


def test_async_loads_are_exact(tiny_model: str, run_dir: Path) -> None:
    batch = prompts(4, [300, 512])
    reference, _, hit, metrics = run(
        tiny_model,
        [
            {"op": "generate", "prompts": batch, "prompt_logprobs": True},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": batch},
            {"op": "metrics"},
        ],
        run_dir,
        {"load_mode": "async"},
    )
    assert_same_outputs(reference, hit)
    # like sync loads, never the prompt's last block: the 512-token prompt loads 480
    assert [r["num_cached_tokens"] for r in hit] == [256, 480]
    assert metrics["vllm:kvtier_load_error_blocks"] == 0


BAD_CONFIGS = [
    ({"no_such_key": 1}, "no_such_key"),
    ({"tiers": ["cpu", "remote"]}, "index_address"),
    ({"store_address": "127.0.0.1:1", "embedded_capacity": "1GiB"}, "one or the other"),
]


# Through a real engine: one error of the config model (a model kvtier refuses from the KV
# cache vLLM allocated: tests/engine/test_model_families.py). The others fail in the same
# model, checked below without a vLLM start.
@pytest.mark.parametrize(("extra", "message"), [BAD_CONFIGS[0]])
def test_bad_connector_config_fails_startup_clearly(
    tiny_model: str, run_dir: Path, extra: dict, message: str
) -> None:
    code, stderr = start_failure(tiny_model, run_dir, extra)
    assert code != 0
    assert message in stderr


@pytest.mark.parametrize(("extra", "message"), BAD_CONFIGS)
def test_bad_connector_config_is_refused_by_the_config_model(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_extra_config(extra)
