"""The fault drills (``kvtier bench faults --model-family F --tensor-parallel-size N``), short,
for each supported row of docs/connector.md's support matrix beyond dense full attention on
one rank (tests/drills/test_fault_drills.py): 0 wrong tokens, 0 engine crashes, 0 leaked
leases, and the fault visibly handled.

- ``gemma3-swa`` (sliding window + full attention, two KV cache groups): a chunk keeps only
  the window's tail of its blocks, loads are async, a failed load fails the whole request
  (vLLM takes a hybrid model's load failures per request). Every prompt in flight at once
  while every load's second chunk fails its checksum (the other drills: ``kvtier bench
  faults --model-family gemma3-swa``).
- ``qwen3-next`` (a gated-delta-net layer's Mamba state beside full attention): a chunk keeps
  the state after its last token, a load fills the state block at the hit boundary; the same
  concurrent drill, with prefill steps of one chunk (so every chunk boundary has its state)
  and of two (so chunks no step ended on are stored as their attention alone, and hits run
  through them to a chunk with its state).
- ``llama4-local`` (three layers attending within 128-token local spans beside a global
  one, MoE; 64-token chunks keep every local block, since a hit inside a span needs the
  span's earlier chunks): the same concurrent drill.
- ``llama`` at TP 2: rank 0's copy of a chunk is corrupt while rank 1's is sound; vLLM must
  recompute on both ranks (it does: it takes the union of the ranks' failed blocks).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.bench.faults.drills import DRILLS
from kvtier.bench.faults.run import DrillContext, DrillResult, Prompts, generate
from kvtier.testing.vllm_driver import run_vllm

pytestmark = pytest.mark.vllm

REQUESTS = 2


def context(tmp: pytest.TempPathFactory, family: str, **engine: int) -> Iterator[DrillContext]:
    ctx = DrillContext(tmp.mktemp(family), REQUESTS, family=family, engine_args=engine)
    yield ctx


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    yield from context(tmp_path_factory, "gemma3-swa")


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    # steps of one chunk (run.FAMILY_ENGINE): vLLM writes the state at every chunk boundary
    yield from context(tmp_path_factory, "qwen3-next")


@pytest.fixture(scope="module")
def mamba_long_steps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    # steps of two chunks: every other chunk boundary has no state (attention alone)
    yield from context(tmp_path_factory, "qwen3-next", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    yield from context(tmp_path_factory, "llama4-local")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillContext]:
    yield from context(tmp_path_factory, "llama", tensor_parallel_size=2)


def run(ctx: DrillContext, name: str) -> DrillResult:
    _, drill = DRILLS[name]
    result = drill(ctx)
    assert result.engine_crashes == 0, result
    assert result.wrong_tokens == 0, result
    assert result.leaked_leases == 0, result
    return result


def test_hybrid_concurrent_requests_with_corrupt_chunks(hybrid: DrillContext) -> None:
    prompts = Prompts.make(REQUESTS, 21)
    hybrid.prefetch(prompts.a + prompts.b)
    result = run(hybrid, "concurrent-failed-loads")
    assert result.recomputes >= 1
    assert result.hits.get("host", 0) > 0  # the phases after the fault hit what was saved


@pytest.mark.parametrize("steps", ["mamba", "mamba_long_steps"])
def test_mamba_hybrid_concurrent_requests_with_corrupt_chunks(
    steps: str, request: pytest.FixtureRequest
) -> None:
    mamba: DrillContext = request.getfixturevalue(steps)
    prompts = Prompts.make(REQUESTS, 22)
    mamba.prefetch(prompts.a + prompts.b)
    _, drill = DRILLS["concurrent-failed-loads"]
    result = drill(mamba)
    assert result.engine_crashes == 0, result
    assert result.leaked_leases == 0, result
    if result.wrong_tokens and not vllm_batch_invariant(mamba, mamba.prompts(21).b):
        # The drill's reference is one request at a time, its phases batch: on a CPU where
        # vLLM itself computes other bits for a prompt prefilled beside another (no connector,
        # no cache: an AVX2-only host's gated-delta-net kernels), a chunk saved from a batched
        # prefill differs from the reference and so does vLLM's own prefix cache. kvtier is
        # then as exact as vLLM's own cache, which is what the rule asks; the drill cannot
        # tell more there.
        pytest.xfail(f"vLLM is not batch-invariant for this model on this CPU: {result}")
    assert result.wrong_tokens == 0, result
    assert result.recomputes >= 1
    assert result.hits.get("host", 0) > 0
    if steps == "mamba_long_steps":  # the hits ran through chunks stored without state
        assert result.counters["save_no_state"] > 0, result.counters


def vllm_batch_invariant(ctx: DrillContext, prompts: list[list[int]]) -> bool:
    """Whether vLLM alone (no connector) gives the same prompt logprobs for ``prompts`` sent
    one at a time and all at once."""
    one = generate(prompts, cache=False) | {"max_tokens": 1}
    spec = {
        "model": str(ctx.model),
        "phases": [one, one | {"batch": True}],
        "kv_transfer_config": None,
        "engine_args": ctx.engine_args,
        "max_model_len": 960,
    }
    alone, together = run_vllm(spec, ctx.env())
    return [o["prompt_logprobs"] for o in alone] == [o["prompt_logprobs"] for o in together]


def test_chunked_local_concurrent_requests_with_corrupt_chunks(local: DrillContext) -> None:
    prompts = Prompts.make(REQUESTS, 23)
    local.prefetch(prompts.a + prompts.b)
    result = run(local, "concurrent-failed-loads")
    assert result.recomputes >= 1
    assert result.hits.get("host", 0) > 0


def test_tp2_one_rank_corrupt_recomputes_on_every_rank(tp2: DrillContext) -> None:
    result = run(tp2, "checksum-mismatch")
    # every B request meets the fault; on a loaded host a chunk the fault overwrote without
    # its load meeting it can fail a later load too (one more recompute, never a wrong token)
    assert result.recomputes >= REQUESTS, result.counters
    # the failing step's new chunks were computed over rank 0's unloaded blocks: on both
    # ranks none is committed (a chunk commits only once every rank copied it)
    assert result.counters["saves_discarded_after_failed_load"] >= 3 * REQUESTS, result.counters
    # at most one chunk deleted per failed load: rank 0's copy, never rank 1's sound one too
    deleted = result.counters["corrupt_chunks_deleted"]
    assert REQUESTS <= deleted <= result.recomputes, result.counters
    assert result.hits.get("host", 0) > 0
