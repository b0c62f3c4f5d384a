"""A conversation's turns picked up by another instance of the node: how much of each turn's
prompt kvtier's DRAM tier serves, beside what vLLM's own prefix cache hits on the instance
that computed it:

    kvtier bench session-turns [--model-family qwen3-next] [--step-tokens 1024]

Each turn's prompt is the previous one plus ``--turn-tokens`` new tokens (an agent's loop).
kvtier's engine clears vLLM's own prefix cache before every turn, so everything it does not
recompute came from the node's pool (what an instance that never saw the session gets);
vLLM alone keeps its cache across the turns (the floor: the hit vLLM's own cache gives the
instance that computed it, same engine settings, same prefill steps). A third engine, vLLM
alone with its cache cleared before every turn, recomputes each turn: kvtier's turns must
sample exactly its tokens with exactly its logprobs wherever vLLM's own cache hits do
(both columns: a recompute prefilled in other steps may round differently, for vLLM alone
too).

Why a Mamba hybrid (the default family): vLLM writes a recurrent state only where a prefill
step ends, and a hit must end on one. ``--chunk-tokens 1`` (the default) rounds up to one KV
block, as a real hybrid model's 384-528-token blocks make a chunk.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from kvtier.testing.models import make_family_model, vllm_env
from kvtier.testing.vllm_driver import kvtier_transfer_config, run_vllm

MAX_MODEL_LEN = 4096  # the tiny models' positions


def run(
    family: str,
    step_tokens: int,
    chunk_tokens: int,
    first_tokens: int,
    turn_tokens: int,
    turns: int,
    max_model_len: int = MAX_MODEL_LEN,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-session-turns-"))
    model = make_family_model(workdir / f"tiny-{family}", family)
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(first_tokens)]]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + [rng.randrange(4, 500) for _ in range(turn_tokens)])
    if len(prompts[-1]) + 8 > max_model_len:
        raise ValueError(f"the last turn ({len(prompts[-1])} tokens) exceeds {max_model_len}")
    env = vllm_env(KVTIER_STORE__RUN_DIR=str(workdir / "run"))
    connector = {"chunk_tokens": chunk_tokens, "min_hit_tokens": {"cpu": 1}}

    def engine(kv: dict | None, reset: bool) -> list[dict]:
        phases: list[dict] = []
        for prompt in prompts:
            if reset:
                phases.append({"op": "reset_prefix_cache"})
            phases.append({"op": "generate", "prompts": [prompt], "max_tokens": 8})
        if kv is not None:
            phases.append({"op": "metrics"})
        spec = {
            "model": str(model),
            "phases": phases,
            "kv_transfer_config": kvtier_transfer_config(kv) if kv is not None else None,
            "engine_args": {"max_num_batched_tokens": step_tokens},
            "max_model_len": max_model_len,
        }
        return [out for out in run_vllm(spec, env) if out is not None]

    kvtier_out = engine(connector, reset=True)
    metrics = kvtier_out.pop() if isinstance(kvtier_out[-1], dict) else {}
    kvtier_turns = [out[0] for out in kvtier_out if isinstance(out, list)]
    own = [out[0] for out in engine(None, reset=False) if isinstance(out, list)]
    recompute = [out[0] for out in engine(None, reset=True) if isinstance(out, list)]
    rows = []
    for i, prompt in enumerate(prompts):
        got, ref = kvtier_turns[i], recompute[i]
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": len(prompt),
                "kvtier_dram_hit": got["num_cached_tokens"],
                "vllm_own_cache_hit": own[i]["num_cached_tokens"],
                "exact": _same(got, ref),
                "vllm_own_exact": _same(own[i], ref),
                "kvtier_s": got["seconds"],
                "vllm_own_s": own[i]["seconds"],
                "recompute_s": ref["seconds"],
            }
        )
    saved_alone = metrics.get("vllm:kvtier_save_no_state", 0)
    return {
        "family": family,
        "step_tokens": step_tokens,
        "chunk_tokens": chunk_tokens,
        "rows": rows,
        "chunks_saved_without_state": saved_alone,
        "chunks_committed": metrics.get("vllm:kvtier_committed_chunks", 0),
    }


def _same(got: dict, ref: dict) -> bool:
    """The same tokens sampled with bit-identical logprobs."""
    return bool(got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"])


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(
        title=f"a session's turns on another instance of the node: {report['family']}, "
        f"{report['step_tokens']}-token prefill steps; kvtier from DRAM (vLLM's cache cleared "
        "each turn) beside vLLM's own cache on the instance that computed it"
    )
    for col in ("turn", "prompt", "kvtier DRAM hit", "vLLM own cache hit", "kvtier exact",
                "vLLM own exact", "kvtier s", "vLLM own s", "recompute s"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in report["rows"]:
        table.add_row(
            str(row["turn"]), str(row["prompt_tokens"]), str(row["kvtier_dram_hit"]),
            str(row["vllm_own_cache_hit"]), "yes" if row["exact"] else "NO",
            "yes" if row["vllm_own_exact"] else "NO",
            f"{row['kvtier_s']:.3f}", f"{row['vllm_own_s']:.3f}", f"{row['recompute_s']:.3f}",
        )  # fmt: skip
    console().print(table)
    console().print(
        f"chunks committed {report['chunks_committed']:.0f}, of them saved without their "
        f"state (attention alone) {report['chunks_saved_without_state']:.0f}"
    )
