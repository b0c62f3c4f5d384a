"""Whether instances of one model with different tensor-parallel sizes compute the same KV:

    kvtier bench tp-numerics --dtypes bfloat16,float32

Why it matters: a hit must give exactly the logprobs the loading instance's own recompute
gives. A chunk computed by a TP-2 instance could be loaded by a TP-1 instance of the same
model (its heads laid out for TP 1) only if TP 2 computed the same bytes. It does not: a
row-parallel layer (attention's output projection, the MLP's down projection) sums each rank's
partial products and all-reduces them, another order of additions than one rank's matmul, so
the hidden state entering the next layer, and that layer's KV, differ in the low bits. So
kvtier keeps the instance's TP size in every namespace, MLA's included (docs/keys/spec.md).

What it runs: the same prompts, with prompt logprobs, in a fresh vLLM engine per
configuration: TP 1 on every core (the reference), TP 1 again (the floor: a run against
itself), TP 1 on one core (what a different thread count changes) and TP 2 (one core per
rank). Each row compares a configuration's prompt logprobs with the reference's, position by
position: how many are bit-identical and the largest difference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvtier.testing.models import FAMILIES, cpu_binding, make_family_model, vllm_env
from kvtier.testing.vllm_driver import run_vllm

# name -> (TP size, cores: 0 = every core, 1 = the first core alone)
CONFIGS: dict[str, tuple[int, int]] = {
    "TP 1, every core (reference)": (1, 0),
    "TP 1 again (floor)": (1, 0),
    "TP 1, one core": (1, 1),
    "TP 2, a core per rank": (2, 0),
}


def run(family: str, dtypes: list[str], lengths: list[int], workdir: Path) -> list[dict[str, Any]]:
    """One row per dtype and configuration (see the module docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {sorted(FAMILIES)}")
    model = make_family_model(workdir / f"tiny-{family}", family)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]
    rows = []
    for dtype in dtypes:
        outputs = {
            name: _prompt_logprobs(model, prompts, dtype, *how) for name, how in CONFIGS.items()
        }
        reference = outputs[next(iter(CONFIGS))]
        for name, got in list(outputs.items())[1:]:
            rows.append({"dtype": dtype, "config": name, **compare(reference, got)})
    return rows


def compare(
    reference: list[list[dict[str, float] | None]], got: list[list[dict[str, float] | None]]
) -> dict[str, Any]:
    """Prompt logprobs of the same prompts, position by position: how many positions are
    bit-identical, and the largest difference of a token's logprob both list."""
    same, total, worst = 0, 0, 0.0
    for want_steps, got_steps in zip(reference, got, strict=True):
        for want, step in zip(want_steps, got_steps, strict=True):
            if want is None or step is None:  # the first position has none
                continue
            total += 1
            same += want == step
            worst = max([worst, *(abs(want[t] - step[t]) for t in set(want) & set(step))])
    return {"positions": total, "identical": same, "max_abs_diff": worst}


def _prompt_logprobs(
    model: Path, prompts: list[list[int]], dtype: str, tp: int, cores: int
) -> list[list[dict[str, float] | None]]:
    phase = {"op": "generate", "prompts": prompts, "prompt_logprobs": True, "max_tokens": 1}
    spec = {
        "model": str(model),
        "dtype": dtype,
        "phases": [phase],
        "kv_transfer_config": None,
        "engine_args": {"tensor_parallel_size": tp},
    }
    if tp > 1:
        binding = cpu_binding(ranks=tp)
    elif cores == 1:
        binding = cpu_binding(slot=0, slots=2)  # the first core alone
    else:
        binding = cpu_binding()
    (outputs,) = run_vllm(spec, vllm_env(**binding))
    return [out["prompt_logprobs"] for out in outputs]


def print_report(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from kvtier.core.logs import console

    table = Table(title="prompt logprobs against TP 1 on every core, same prompts and model")
    for col in ("dtype", "configuration", "positions", "bit-identical", "max |Δ logprob|"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["dtype"],
            r["config"],
            str(r["positions"]),
            str(r["identical"]),
            f"{r['max_abs_diff']:.3g}",
        )
    console().print(table)
