"""The remote tier end to end: vLLM on "node A" gets exact hits for prompts first served on
"node B", pulled from B's store over the Mooncake transfer engine (TCP on loopback), found
through the index; and a holder that dies, stalls or serves bad bytes ends in a recompute."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from kvtier.testing.services import wait_indexed
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

from support.helpers import StoreProcess, start_index_process, start_store_process
from support.vllm_fixtures import make_tiny_llama, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.remote]

CHUNK = 64
REMOTE_ENV = {
    "KVTIER_STORE__REMOTE__FETCH_TIMEOUT_S": "1.5",
    "KVTIER_STORE__REMOTE__QUARANTINE_S": "6",
}
P2P = "vllm:prompt_tokens_cached_by_source{source=p2p}"
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture
def cluster(run_dir: Path):
    """An index, and two node stores with the remote tier that announce themselves there: the
    index follows both, and each store fetches from the node stores the index lists."""
    index = start_index_process()
    stores = [
        start_store_process(
            run_dir, "256MiB", "--remote", "--index", index.address, node_id=node, env=REMOTE_ENV
        )
        for node in ("node-a", "node-b")
    ]
    a, b = stores
    try:
        yield a, b, index
    finally:
        for store in stores:  # thaw both first: a store leaving ends its calls to the other
            if store.proc.poll() is None:
                store.proc.send_signal(signal.SIGCONT)
        for store in stores:  # before the index: a store leaving unregisters itself there
            store.stop()
        index.stop()


def run(
    model: str,
    phases: list[dict],
    run_dir: Path,
    store: StoreProcess,
    index: object,
    engine_args: dict | None = None,
    **extra: object,
) -> list:
    extra = {
        "chunk_tokens": CHUNK,
        "min_hit_tokens": {"cpu": CHUNK, "remote": CHUNK},
        "store_address": store.address,
        "index_address": index.address,
        "tiers": ["cpu", "remote"],
        "remote_fetch_timeout_s": 3.0,
    } | extra
    spec = {"model": model, "phases": phases, "kv_transfer_config": kvtier_transfer_config(extra)}
    spec["engine_args"] = engine_args or {}
    return run_vllm(spec, vllm_env(KVTIER_STORE__RUN_DIR=str(run_dir)))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]


def test_remote_hits_are_exact_and_land_locally(tiny_model: str, run_dir: Path, cluster) -> None:
    a, b, index = cluster
    batch = prompts(11, [400, 300])
    # node B: computes (and stores) the prompts
    reference = run(
        tiny_model,
        [{"op": "generate", "prompts": batch, "prompt_logprobs": True}],
        run_dir,
        b,
        index,
    )[0]
    wait_indexed(index, "node-b", 6 + 4)
    # node A: its store is empty; the index says node B holds them
    remote, metrics, _, again, metrics2 = run(
        tiny_model,
        [
            {"op": "generate", "prompts": batch},
            {"op": "metrics"},
            {"op": "reset_prefix_cache"},
            {"op": "generate", "prompts": batch},  # now a DRAM hit on node A
            {"op": "metrics"},
        ],
        run_dir,
        a,
        index,
    )
    for ref, out in zip(reference, remote, strict=True):
        assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"]
    assert [r["num_cached_tokens"] for r in remote] == [384, 256]
    assert metrics[P2P] == 384 + 256 and metrics[HOST] == 0
    assert metrics["vllm:kvtier_remote_pulled_chunks"] == 6 + 4
    for ref, out in zip(reference, again, strict=True):
        assert out["tokens"] == ref["tokens"] and out["logprobs"] == ref["logprobs"]
    assert metrics2[HOST] - metrics[HOST] == 384 + 256  # pulled chunks stayed on node A
    assert metrics2[P2P] == metrics[P2P]


@pytest.mark.parametrize("fault", ["kill", "stall", "corrupt"])
def test_holder_failures_end_in_recompute(
    tiny_model: str, run_dir: Path, cluster, fault: str
) -> None:
    a, b, index = cluster
    batch = prompts(12, [400])
    reference = run(
        tiny_model,
        [{"op": "generate", "prompts": batch, "prompt_logprobs": True}],
        run_dir,
        b,
        index,
    )[0]
    wait_indexed(index, "node-b", 6)
    if fault == "kill":
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)
    elif fault == "stall":
        b.proc.send_signal(signal.SIGSTOP)
    else:
        from kvtier.store.client.shm import SharedSegment

        size = Path("/dev/shm", b.segment).stat().st_size  # the pool, then the store's view
        segment = SharedSegment.attach(b.segment, size)
        segment.array[: 256 << 20] ^= 0xFF  # every pool byte flipped: checksums cannot match
        segment.close()
    start = time.monotonic()
    got, metrics = run(
        tiny_model, [{"op": "generate", "prompts": batch}, {"op": "metrics"}], run_dir, a, index
    )
    elapsed = time.monotonic() - start
    assert got[0]["tokens"] == reference[0]["tokens"]
    assert got[0]["logprobs"] == reference[0]["logprobs"]
    assert metrics[P2P] == 0  # nothing was served from the remote tier
    assert elapsed < 120  # no hang: the pull has a deadline
    failures = sum(
        v
        for k, v in metrics.items()
        if k.startswith("vllm:kvtier_remote_fetch_") and k != "vllm:kvtier_remote_fetch_seconds"
    )
    assert failures >= 1


def test_a_mamba_hybrids_remote_hit_runs_through_chunks_stored_without_state(
    run_dir: Path, cluster, tmp_path: Path
) -> None:
    """Qwen3-Next geometry in prefill steps of two chunks: node B stores every other chunk as
    its attention alone (no state there); node A pulls the run from both namespaces in turn
    and loads it up to the last chunk with its state, exactly."""
    from kvtier.testing.models import make_tiny_qwen3_next

    a, b, index = cluster
    model = str(make_tiny_qwen3_next(tmp_path / "qwen3-next"))
    steps = {"max_num_batched_tokens": 2 * CHUNK}
    (prompt,) = prompts(13, [600])

    def engine(phases: list[dict], store: StoreProcess) -> list:
        return run(model, phases, run_dir, store, index, engine_args=steps)

    reference, metrics_b = engine(
        [{"op": "generate", "prompts": [prompt], "prompt_logprobs": True}, {"op": "metrics"}], b
    )
    assert metrics_b["vllm:kvtier_save_no_state"] >= 4  # chunks 1, 3, 5 and 7 at least
    wait_indexed(index, "node-b", 9)  # both namespaces' chunks
    remote, metrics = engine([{"op": "generate", "prompts": [prompt]}, {"op": "metrics"}], a)
    assert remote[0]["tokens"] == reference[0]["tokens"]
    assert remote[0]["logprobs"] == reference[0]["logprobs"]
    hit = remote[0]["num_cached_tokens"]
    assert hit >= 8 * CHUNK, metrics  # through chunks without state, to one with its state
    assert metrics[P2P] == hit and metrics[HOST] == 0
    assert metrics["vllm:kvtier_load_error_blocks"] == 0
