"""Faults the vLLM driver injects into a running engine, for the fault drills.

A fault phase arms a hook on the scheduler-side connector's ``update_state_after_alloc``: it
fires when vLLM has just allocated blocks for an external load (after the lookup, before the
workers copy). ``"every": true`` fires it for every load, otherwise once; a ``disarm`` phase
turns every fault off. Kinds:

    stall            {"seconds": s}      the scheduler thread stalls (a lease may lapse)
    kill_store       {"pid", "segment"}  SIGKILL the store, unlink its pool
    restart_store    {"pid", "argv", "ready_file", "when": "before" | "after"}
                                         SIGKILL the store and start another on the same
                                         address; the connector re-attaches to it at once (as
                                         a concurrent lookup would), before or after vLLM's
                                         allocation is turned into a load job
    hang_store       {"pid"}             SIGSTOP the store (the test sends SIGCONT)
    unlink_segment   {"segment"}         remove the pool's /dev/shm file (store alive)
    corrupt_pool     {"segment"}         overwrite every byte of the pool
    corrupt_chunk    {"segment", "chunk"} overwrite the bytes of the request's chunk #chunk
                                         (of the run being loaded, rank 0)
    copy_error       {}                  the worker's next page copy raises

These touch the connector's internals on purpose (a fault nothing else can produce on
demand); everything else in a drill is the real engine, store and sockets.

``damage_files`` (the driver's ``damage_files`` phase) damages the disk tier's chunk files
between requests, as a failing disk or a stray writer would: no hook, real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

START_ATTEMPTS = 5  # a restarted store that exits at once (see _restart_store) is retried


def scheduler_connector(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    engine = getattr(core, "engine_core", core)
    return engine.scheduler.connector


def arm(llm: Any, phase: dict) -> None:
    connector = scheduler_connector(llm)
    original = connector.update_state_after_alloc
    if not hasattr(connector, "_unfaulted"):
        connector._unfaulted = original
    state = {"fired": False}
    after = phase["kind"] == "restart_store" and phase.get("when") == "after"

    def faulty(request: Any, blocks: Any, num_external_tokens: int) -> None:
        fire = num_external_tokens and (phase.get("every") or not state["fired"])
        if fire:
            state["fired"] = True
            if not after:
                _fire_safely(connector, request, phase)
        original(request, blocks, num_external_tokens)
        if fire and after:
            _fire_safely(connector, request, phase)

    connector.update_state_after_alloc = faulty


def disarm(llm: Any) -> None:
    """Every armed fault off: the connector's own hook again."""
    connector = scheduler_connector(llm)
    original = getattr(connector, "_unfaulted", None)
    if original is not None:
        connector.update_state_after_alloc = original
        del connector._unfaulted


def _fire_safely(connector: Any, request: Any, phase: dict) -> None:
    """The harness's own failure (a store that would not restart in time) must not surface as
    an exception inside vLLM's scheduler, which the drill would then count as a crash of the
    engine: it is reported on stderr and the drill's counters show the fault did not fire."""
    try:
        _fire(connector, request, phase)
    except Exception as exc:
        import sys

        print(f"fault injection {phase.get('kind')!r} failed: {exc!r}", file=sys.stderr)


def _fire(connector: Any, request: Any, phase: dict) -> None:
    kind = phase["kind"]
    if kind == "stall":
        time.sleep(phase["seconds"])
    elif kind == "kill_store":
        os.kill(phase["pid"], signal.SIGKILL)
        Path("/dev/shm", phase["segment"]).unlink(missing_ok=True)
    elif kind == "restart_store":
        _restart_store(connector, phase)
    elif kind == "hang_store":
        os.kill(phase["pid"], signal.SIGSTOP)
    elif kind == "unlink_segment":
        Path("/dev/shm", phase["segment"]).unlink(missing_ok=True)
    elif kind == "corrupt_pool":
        _overwrite(phase["segment"], None)
    elif kind == "corrupt_chunk":
        outcome = connector.scheduler._requests[request.request_id].outcome
        hits = outcome.hits[0]
        chunk = min(phase.get("chunk", 0), len(hits) - 1)
        _overwrite(phase["segment"], hits[chunk].extents)
    elif kind == "copy_error":
        _break_next_copy()
    else:
        raise ValueError(f"unknown fault {kind!r}")


def damage_files(
    directory: Path, every: int = 1, how: str = "flip", spare: frozenset[Path] = frozenset()
) -> int:
    """Damage every ``every``-th chunk file under the disk tier's ``directory`` (sorted by
    path) that is not in ``spare``: ``flip`` the last data byte, ``truncate`` the last 100
    bytes, or ``header`` (flip a byte of the header). Returns how many were damaged."""
    files = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.name != ".lock" and ".tmp-" not in p.name and p not in spare
    )
    damaged = 0
    for path in files[::every]:
        try:
            if how == "truncate":
                os.truncate(path, max(0, path.stat().st_size - 100))
            else:
                with path.open("r+b") as f:
                    f.seek(
                        -1 if how == "flip" else 20, os.SEEK_END if how == "flip" else os.SEEK_SET
                    )
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
            damaged += 1
        except FileNotFoundError:  # evicted from the disk meanwhile
            continue
    return damaged


def _restart_store(connector: Any, phase: dict) -> None:
    """SIGKILL the store, then start another with the same arguments once the old one is
    gone (its port and lock file free), and wait for its ready line: both waits end when the
    processes do, however slowly a loaded machine runs them. A start that still exits
    without a ready line (its port or lock not free yet) is tried again, a few times."""
    from kvtier.testing.services import process_state

    old_pid = int(phase["pid"])
    ready_file = Path(phase["ready_file"])
    if ready_file.exists():  # restarted before: the store to kill is the last one started
        old_pid = json.loads(ready_file.read_text())["pid"]
    os.kill(old_pid, signal.SIGKILL)
    while process_state(old_pid) != "gone":  # SIGKILL cannot be ignored: a matter of time
        time.sleep(0.02)
    for _ in range(START_ATTEMPTS):
        proc = subprocess.Popen(  # not the driver's stderr: its reader waits for EOF
            phase["argv"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready line, or EOF once it exited
        if line:
            ready = json.loads(line)
            ready["pid"] = proc.pid
            ready_file.write_text(json.dumps(ready))
            break
        proc.wait()
        time.sleep(0.1)
    else:
        raise RuntimeError(f"the restarted store exited without a ready line {START_ATTEMPTS}x")
    connector.scheduler.pool.reattach()


def _overwrite(segment_name: str, extents: Any) -> None:
    import numpy as np

    from kvtier.store.client.shm import SharedSegment

    size = Path("/dev/shm", segment_name).stat().st_size
    segment = SharedSegment.attach(segment_name, size)
    try:
        if extents is None:
            segment.array[:] = np.uint8(0x5A)
        else:
            for offset, length in extents:
                segment.array[offset : offset + length] = np.uint8(0x5A)
    finally:
        segment.close()


def _break_next_copy() -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = getattr(get_kv_transfer_group(), "worker")  # noqa: B009 - kvtier's own
    kv = worker.kv
    original = kv.load_layer

    def broken(*args: Any, **kwargs: Any) -> None:
        kv.load_layer = original  # once
        raise RuntimeError("injected copy failure")

    kv.load_layer = broken


def first_chunk_files(llm: Any, directory: Path, prompts: list[list[int]]) -> frozenset[Path]:
    """The disk tier's files of each prompt's first chunk (rank 0's namespace): what a drill
    keeps sound so every stage finds one good chunk before the damaged ones, whatever the
    keys (they change with the model's path) put where in the sorted listing."""
    from kvtier.core.keys import prompt_keys
    from kvtier.store.disk.files import chunk_path

    scheduler = scheduler_connector(llm).scheduler
    namespace = scheduler.identity.namespace(scheduler.geometry, 0)
    out = set()
    for prompt in prompts:
        keys = prompt_keys(namespace, prompt)
        if keys:
            out.add(chunk_path(directory, namespace.root_key(), keys[0]))
    return frozenset(out)
