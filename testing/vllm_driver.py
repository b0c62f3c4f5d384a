"""Drive a real vLLM instance (in-process engine) through a script of phases, in its own process.

Benchmarks and tests start it with ``run_vllm(spec)``; it prints one JSON result line. Each
instance is its own process, as in production, and vLLM's global state never enters the
caller's process.

spec = {"model": path, "kv_transfer_config": {...} | None, "block_size": 32, ...,
        "preload": [modules imported before vLLM], "kv_events_config": {...} | None,
        "engine_args": {more vllm.LLM arguments, e.g. hf_overrides}, "phases": [...]}. Phases:
    {"op": "generate", "prompts": [[ids...] | {"tokens": [...], "cache_salt": s,
                                               "image": seed}, ...],
     "max_tokens": 8, "prompt_logprobs": false, "skip_reading_prefix_cache": null}
        requests run one after the other (vLLM's kernels are not batch-invariant, so exactness
        comparisons need identical batches); per request: tokens, logprobs, num_cached_tokens,
        seconds (the whole generate: TTFT when max_tokens=1) and the prompt tokens vLLM counted
        as cached, by source (device = its own GPU cache, host = DRAM, p2p = remote)
    {"op": "reset_prefix_cache"}     clears vLLM's own prefix cache only (fails if vLLM refuses)
    {"op": "settle"}                 the engine idle and every store call the connector queued
                                     done (saves committed, leases released), however long;
                                     with "address" and "pid", also every committed chunk
                                     checksummed by that store
    {"op": "store_leases", "address": a, "pid": N}  leases the store holds, settled first;
                                     asked for as long as process N runs (0 once it exited)
    {"op": "metrics"}                vLLM's counters (vllm:* names)
    {"op": "connector_timing"}       seconds spent in the scheduler-side connector per step
    {"op": "sleep", "seconds": s}    let background work happen (e.g. an index following)
    {"op": "write_file", "path": p, "text": t}  write a file (``testing.disk_faults`` reads
                                     its control file before each chunk-file call)
    {"op": "signal", "pid": N, "signal": "SIGSTOP"}  signal another process (a store)
    {"op": "fault", "kind": ..., ...}  fault injection (``fault_injection.py``): fired right
                                     after a lookup, before its load, once or "every" time
    {"op": "disarm"}                 every fault off
    {"op": "damage_files", "dir": d, "every": n, "how": "flip", "spare_first_of": [prompts]}
                                     damage the disk tier's chunk files but the first chunk of
                                     each prompt given (``fault_injection.damage_files``);
                                     returns how many
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

from kvtier.testing.fault_injection import arm as arm_fault
from kvtier.testing.fault_injection import damage_files, first_chunk_files, scheduler_connector
from kvtier.testing.fault_injection import disarm as disarm_faults
from kvtier.testing.services import store_leases, store_stats
from kvtier.testing.vllm_forkserver import ENV as FORKSERVER_ENV
from kvtier.testing.vllm_forkserver import run as forked_run

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
    """Run the driver in a fresh process; returns the phases' results (raises on failure).
    With ``KVTIER_VLLM_FORKSERVER`` set (the tests), the process is forked from one that
    imported vLLM already (``vllm_forkserver``)."""
    server = os.environ.get(FORKSERVER_ENV)  # a socket path: fork runs from a warm process
    if server and not spec.get("preload"):
        return _run_forked(Path(server), spec, env, timeout)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.testing.vllm_driver"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env),
    )
    for line in proc.stderr.splitlines():  # the harness's own trouble, for whoever reads on
        if line.startswith("fault injection"):
            print(line, file=sys.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX) and proc.returncode == 0:
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def _run_forked(server: Path, spec: dict, env: Mapping[str, str], timeout: float) -> list[Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvtier-driver-") as tmp:
        rc, result, stderr = forked_run(server, spec, dict(env), timeout, Path(tmp))
    for line in stderr.splitlines():
        if line.startswith("fault injection"):
            print(line, file=sys.stderr)
    if rc == 0 and result is not None:
        return result
    raise RuntimeError(f"vLLM driver failed ({rc}):\n{stderr[-4000:]}")


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
        self.longest = 0.0  # the longest single hook call: what stalls the engine
        connector = scheduler_connector(llm)
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
                took = time.perf_counter() - start
                self.seconds += took
                self.longest = max(self.longest, took)
                self.steps += counts_step

        return timed

    def take(self) -> dict[str, float]:
        out = {"seconds": self.seconds, "steps": self.steps, "longest": self.longest}
        self.seconds, self.steps, self.longest = 0.0, 0, 0.0
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

    params = SamplingParams(
        temperature=0.0,
        max_tokens=phase.get("max_tokens", 8),
        logprobs=phase.get("logprobs", 5),
        prompt_logprobs=1 if phase.get("prompt_logprobs") else None,
        skip_reading_prefix_cache=phase.get("skip_reading_prefix_cache"),
        detokenize=False,
        ignore_eos=True,
    )
    if phase.get("batch"):  # every prompt in flight at once: the engine batches them
        return _generate_batch(llm, phase["prompts"], params)
    results: list[dict[str, Any]] = []
    for prompt in phase["prompts"]:
        before = _cached_by_source(_metrics(llm))
        start = time.perf_counter()
        try:
            out = llm.generate([_tokens_prompt(prompt)], params, use_tqdm=False)[0]
        except Exception as exc:  # a request the engine refused: recorded, the run goes on
            results.append({"error": repr(exc)})
            continue
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


def _tokens_prompt(prompt: list[int] | dict) -> Any:
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, dict):
        tokens_prompt = TokensPrompt(prompt_token_ids=prompt["tokens"])
        if prompt.get("cache_salt") is not None:
            tokens_prompt["cache_salt"] = prompt["cache_salt"]
        if prompt.get("image") is not None:  # the model's image token stands in the tokens
            tokens_prompt["multi_modal_data"] = {"image": seeded_image(prompt["image"])}
        return tokens_prompt
    return TokensPrompt(prompt_token_ids=prompt)


def seeded_image(seed: int, size: int = 112) -> Any:
    """A square RGB image of seeded noise: the same seed, the same pixels (and mm hash)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _generate_batch(llm: Any, prompts: list, params: Any) -> list[dict]:
    """All prompts submitted together: concurrent requests sharing prefixes, preempted when
    the KV cache is small. Per-request outputs as ``_generate``'s (no per-request sources)."""
    start = time.perf_counter()
    outs = llm.generate([_tokens_prompt(p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [
        {
            "tokens": list(out.outputs[0].token_ids),
            "logprobs": [
                {str(t): lp.logprob for t, lp in step.items()}
                for step in (out.outputs[0].logprobs or [])
            ],
            "prompt_logprobs": [
                None if step is None else {str(t): lp.logprob for t, lp in step.items()}
                for step in (out.prompt_logprobs or [])
            ],
            "num_cached_tokens": out.num_cached_tokens,
            "finish_reason": out.outputs[0].finish_reason,
            "seconds": seconds,
            "cached_by_source": {},
        }
        for out in outs
    ]


def _settle(llm: Any) -> None:
    """Until the engine is idle and the scheduler-side connector has made every store call it
    queued: commits, releases and aborts run on its own threads, in order, so a no-op queued
    behind them returns once they are done. Waits on the work itself, not for a set time."""
    _drain(llm)
    scheduler = getattr(scheduler_connector(llm), "scheduler", None)  # None: no kvtier
    for name in ("_alloc", "_ops"):  # allocations first: a late one may queue an abort
        executor = getattr(scheduler, name, None)
        if executor is not None:
            executor.submit(lambda: None).result()


def _store_checksummed(address: str, pid: int) -> None:
    """Until the store has computed the checksum of every chunk committed to it (it does so
    off the writer's path, just after the commit): a lookup with ``verify_loads`` ends before
    a chunk still without one. Asked for as long as process ``pid`` runs."""
    while True:
        stats = store_stats(address, pid)
        if stats is None or not int(stats.get("unsummed_chunks", 0)):
            return
        time.sleep(0.01)


def _store_leases(llm: Any, address: str, pid: int, settle_s: float) -> int:
    """Leases the store holds now, this engine alive and idle (its session still open, so a
    leaked lease is still there to count), once the connector has settled (``_settle``). The
    store is asked for as long as its process ``pid`` runs (``store_stats``). A count above 0
    is re-read until ``settle_s``: a lookup abandoned past its deadline may still release
    its lease from a lookup thread; what stays is a leak."""
    _settle(llm)
    deadline = time.monotonic() + settle_s
    while True:
        held = store_leases(address, pid) - _held_ahead(llm)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def _held_ahead(llm: Any) -> int:
    """Write leases of the pool space the connector holds ahead for saves (its ``SaveSlab``:
    held on purpose, given back at shutdown or with its session), which a leak count leaves
    out."""
    scheduler = getattr(scheduler_connector(llm), "scheduler", None)
    slab = getattr(getattr(scheduler, "saves", None), "slab", None)
    return len(slab.lease_ids()) if slab is not None else 0


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

    args: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "auto"),
        "block_size": spec.get("block_size", 32),
        "max_model_len": spec.get("max_model_len", 2048),
        "max_num_seqs": spec.get("max_num_seqs", 8),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens"),
        "enforce_eager": True,
        "seed": 0,
        "kv_cache_memory_bytes": spec.get("kv_cache_bytes", 64 << 20),
        "disable_log_stats": False,
        "kv_transfer_config": spec.get("kv_transfer_config"),
        "kv_events_config": spec.get("kv_events_config"),
    }
    llm = LLM(**(args | spec.get("engine_args", {})))  # engine_args win (e.g. enforce_eager)
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
            elif op == "settle":
                _settle(llm)
                if "address" in phase:  # and the store's checksums of what was committed
                    _store_checksummed(phase["address"], phase["pid"])
                results.append(None)
            elif op == "store_leases":
                address, pid = phase["address"], phase["pid"]
                results.append(_store_leases(llm, address, pid, phase.get("settle_s", 3.0)))
            elif op == "fault":
                arm_fault(llm, phase)
                results.append(None)
            elif op == "disarm":
                disarm_faults(llm)
                results.append(None)
            elif op == "signal":  # e.g. SIGKILL / SIGSTOP / SIGCONT a store
                os.kill(phase["pid"], getattr(signal, phase["signal"]))
                results.append(None)
            elif op == "sleep":
                time.sleep(phase["seconds"])
                results.append(None)
            elif op == "write_file":  # e.g. what a store's injected disk faults read
                Path(phase["path"]).write_text(phase["text"])
                results.append(None)
            elif op == "damage_files":
                how, directory = phase.get("how", "flip"), Path(phase["dir"])
                spare = first_chunk_files(llm, directory, phase.get("spare_first_of", []))
                results.append(damage_files(directory, phase.get("every", 1), how, spare))
            elif op == "connector_timing":
                if timer is None:
                    timer = _ConnectorTimer(llm)
                results.append(timer.take())
            else:
                raise ValueError(f"unknown phase {op!r}")
        _drain(llm)  # let work the engine still owes finish (e.g. saves of finished requests)
    finally:
        llm.llm_engine.engine_core.shutdown()  # runs the connector's shutdown (frees its pool)
    return results


if __name__ == "__main__":
    # The spec comes on stdin (prompts of 8k tokens do not fit in argv).
    print(RESULT_PREFIX + json.dumps(main(json.loads(sys.stdin.read()))), flush=True)
