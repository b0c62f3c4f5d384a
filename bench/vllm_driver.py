"""Drive a real vLLM instance (in-process engine) through a script of phases, in its own process.

Benchmarks and tests start it with ``run_vllm(spec)``; it prints one JSON result line. Each
instance is its own process, as in production, and vLLM's global state never enters the
caller's process.

spec = {"model": path, "kv_transfer_config": {...} | None, "block_size": 32, ...,
        "preload": [modules imported before vLLM], "kv_events_config": {...} | None,
        "phases": [...]}. Phases:
    {"op": "generate", "prompts": [[ids...]...], "max_tokens": 8, "prompt_logprobs": false,
     "skip_reading_prefix_cache": null}
        requests run one after the other (vLLM's kernels are not batch-invariant, so exactness
        comparisons need identical batches); per request: tokens, logprobs, num_cached_tokens,
        seconds (the whole generate: TTFT when max_tokens=1) and the prompt tokens vLLM counted
        as cached, by source (device = its own GPU cache, host = DRAM, p2p = remote)
    {"op": "reset_prefix_cache"}     clears vLLM's own prefix cache only (fails if vLLM refuses)
    {"op": "metrics"}                vLLM's counters (vllm:* names)
    {"op": "connector_timing"}       seconds spent in the scheduler-side connector per step
    {"op": "sleep", "seconds": s}    let background work happen (e.g. an index following)
    {"op": "fault", ...}             fault injection, fired once right after the next lookup
                                     and before its load (tests of the failure paths):
        "kind": "kill_store", "pid": N, "segment": name   SIGKILL the store, unlink its pool
        "kind": "stall", "seconds": s                     the scheduler thread stalls
        "kind": "corrupt_pool", "segment": name           overwrite every byte of the pool
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULT_PREFIX = "KVTIER-RESULT "
SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def kvtier_transfer_config(extra: dict | None = None) -> dict:
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra or {},
    }


def run_vllm(spec: dict, env: Mapping[str, str], timeout: float = 900) -> list[Any]:
    """Run the driver in a fresh process; returns the phases' results (raises on failure)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.bench.vllm_driver"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env),
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX) and proc.returncode == 0:
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _scheduler_connector(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    engine = getattr(core, "engine_core", core)
    return engine.scheduler.connector


def _arm_fault(llm: Any, phase: dict) -> None:
    connector = _scheduler_connector(llm)
    original = connector.update_state_after_alloc
    fired = {"done": False}

    def faulty(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens and not fired["done"]:
            fired["done"] = True
            if phase["kind"] == "kill_store":
                os.kill(phase["pid"], signal.SIGKILL)
                Path("/dev/shm", phase["segment"]).unlink(missing_ok=True)
            elif phase["kind"] == "stall":
                time.sleep(phase["seconds"])
            elif phase["kind"] == "corrupt_pool":
                import numpy as np

                from kvtier.tiers.cpu.shm import SharedSegment

                size = Path("/dev/shm", phase["segment"]).stat().st_size
                segment = SharedSegment.attach(phase["segment"], size)
                segment.array[:] = np.uint8(0x5A)
                segment.close()
            else:
                raise ValueError(f"unknown fault {phase['kind']!r}")
        original(request, blocks, num_external_tokens)

    connector.update_state_after_alloc = faulty


class _ConnectorTimer:
    """Wraps the scheduler-side connector hooks to time them (per engine step)."""

    HOOKS = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
    )

    def __init__(self, llm: Any) -> None:
        self.seconds = 0.0
        self.steps = 0
        connector = _scheduler_connector(llm)
        for name in self.HOOKS:
            setattr(
                connector,
                name,
                self._wrap(getattr(connector, name), name == "build_connector_meta"),
            )

    def _wrap(self, fn: Any, counts_step: bool) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += counts_step

        return timed

    def take(self) -> dict[str, float]:
        out = {"seconds": self.seconds, "steps": self.steps}
        self.seconds, self.steps = 0.0, 0
        return out


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None or not isinstance(value, int | float):
            continue
        labels = ",".join(
            f"{k}={v}"
            for k, v in sorted(metric.labels.items())
            if k not in ("engine", "model_name")
        )
        out[f"{metric.name}{{{labels}}}" if labels else metric.name] = float(value)
    return out


def _cached_by_source(metrics: dict[str, float]) -> dict[str, float]:
    return {
        s: metrics.get(f"vllm:prompt_tokens_cached_by_source{{source={s}}}", 0.0) for s in SOURCES
    }


def _generate(llm: Any, phase: dict) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=phase.get("max_tokens", 8),
        logprobs=phase.get("logprobs", 5),
        prompt_logprobs=1 if phase.get("prompt_logprobs") else None,
        skip_reading_prefix_cache=phase.get("skip_reading_prefix_cache"),
        detokenize=False,
        ignore_eos=True,
    )
    results = []
    for prompt in phase["prompts"]:
        before = _cached_by_source(_metrics(llm))
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        after = _cached_by_source(_metrics(llm))
        completion = out.outputs[0]
        results.append(
            {
                "tokens": list(completion.token_ids),
                "logprobs": [
                    {str(t): lp.logprob for t, lp in step.items()}
                    for step in (completion.logprobs or [])
                ],
                "prompt_logprobs": [
                    None if step is None else {str(t): lp.logprob for t, lp in step.items()}
                    for step in (out.prompt_logprobs or [])
                ],
                "num_cached_tokens": out.num_cached_tokens,
                "finish_reason": completion.finish_reason,
                "seconds": seconds,
                "cached_by_source": {
                    s: after[s] - before[s] for s in SOURCES if after[s] != before[s]
                },
            }
        )
    return results


def _drain(llm: Any) -> None:
    """Run engine steps until no request is left. ``LLM.generate`` returns before the step that
    lets a connector with asynchronous saves hand back the last request's blocks; until then
    vLLM refuses to reset its prefix cache."""
    core = llm.llm_engine.engine_core
    engine = getattr(core, "engine_core", core)
    while engine.scheduler.has_requests():
        engine.step()


def main(spec: dict) -> list[Any]:
    import importlib

    for module in spec.get("preload", []):  # e.g. a peer's compatibility fix, before vLLM
        importlib.import_module(module)
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "auto"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=spec.get("max_num_seqs", 8),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        disable_log_stats=False,
        kv_transfer_config=spec.get("kv_transfer_config"),
        kv_events_config=spec.get("kv_events_config"),
    )
    results: list[Any] = []
    timer: _ConnectorTimer | None = None
    try:
        for phase in spec["phases"]:
            op = phase["op"]
            if op == "generate":
                results.append(_generate(llm, phase))
            elif op == "reset_prefix_cache":
                _drain(llm)
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache")
                results.append(True)
            elif op == "metrics":
                results.append(_metrics(llm))
            elif op == "fault":
                _arm_fault(llm, phase)
                results.append(None)
            elif op == "sleep":
                time.sleep(phase["seconds"])
                results.append(None)
            elif op == "connector_timing":
                if timer is None:
                    timer = _ConnectorTimer(llm)
                results.append(timer.take())
            else:
                raise ValueError(f"unknown phase {op!r}")
    finally:
        llm.llm_engine.engine_core.shutdown()  # runs the connector's shutdown (frees its pool)
    return results


if __name__ == "__main__":
    # The spec comes on stdin (prompts of 8k tokens do not fit in argv).
    print(RESULT_PREFIX + json.dumps(main(json.loads(sys.stdin.read()))), flush=True)
