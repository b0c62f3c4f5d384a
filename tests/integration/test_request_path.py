"""The product files one request passes through, traced and pinned (docs/design.md, "One
request, file by file").

A real engine (vLLM's ``Scheduler`` driving the connector: ``support.engine_rig``) gets a DRAM
hit from an embedded store and from a served one, and a remote hit: its node's store pulls the
run from another node's store over the Mooncake transfer engine (TCP on loopback), found
through the index. The stores and the index serve gRPC in this process, on their own threads,
so both sides of every call are traced.

What is recorded: every product file (under the repository root; not ``tests/``,
``testing/``, generated ``*_pb2*``) whose code runs, on

- the engine side: inside the hooks that carry the hit (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``; the worker's ``start_load_kv``, ``wait_for_layer_load``), and
  on the connector's own threads (lookups, the load's copy thread), from the lookup to the end
  of the copy;
- the store side: inside the store's gRPC handlers of the calls the request makes, split into
  the engine's node store ("store") and, for a remote hit, the store holding the run
  ("holder"). Background calls (session heartbeats, the index following the stores) and a
  client's attach (``Info``) are not the request's and are not recorded; neither is the
  index's side of the query, nor the stores' background threads.

Files of ``core/`` (keys, errors, chunk vocabulary, gRPC plumbing, permissions) are the shared
plumbing every layer uses: pinned apart, as "(plumbing)". A change to what a request passes
through fails here: update the lists below and the table in docs/design.md together (the last
test checks that they agree).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"{ROOT}/"
NOT_PRODUCT = ("tests/", "testing/", ".venv/", "build/")
PLUMBING = "core/"
CHUNK = 32
PROMPT = list(range(4, 4 + 4 * CHUNK + 1))  # four chunks and a token: the hit is 128 tokens
# store RPCs that are not the request's: heartbeats, the index following the stores, attaching
BACKGROUND_RPCS = {"Heartbeat", "ReadEvents", "Snapshot", "Stats", "Info"}
ENGINE_THREADS = ("kvtier-lookup", "kvtier-ops", "kvtier-alloc", "kvtier-load")

# -- the pinned lists (docs/design.md, "One request, file by file") ------------------------------

ENGINE = [  # every hit: vLLM's hooks, the scheduler side, the pool tier, the worker's copy
    "connector/counters.py",
    "connector/group_blocks.py",  # which blocks of each KV cache group a load fills
    "connector/layout.py",
    "connector/load_copies.py",  # the load's copies per rank
    "connector/load_sums.py",  # the loaded chunks' checksums
    "connector/lookup.py",
    "connector/lookup_waits.py",  # the lookup in flight, waited for within the step's budget
    "connector/paged_kv.py",
    "connector/request_state.py",  # what a request keeps, what its lookup found
    "connector/scheduler.py",
    "connector/streams.py",
    "connector/sync_loads.py",  # the layer-wise load thread
    "connector/vllm_connector.py",
    "connector/worker.py",
    "store/client/shm.py",
    "tiers/cpu.py",
]
STATE_MACHINE = [  # StoreCore's lookup and the components it calls
    "store/pool/eviction.py",
    "store/state/core.py",
    "store/state/ids.py",  # a leased lookup's lease id
    "store/state/leases.py",
    "store/state/lifetimes.py",  # what time ended, first in every operation
    "store/state/limits.py",
    "store/state/namespaces.py",
    "store/state/pages.py",
    "store/state/sessions.py",
]
# a served store: the client, whose shared view says the lookup is no known miss and whose
# lease region leases the hit (kvtier.store.client.view_leases): no call reaches the store
GRPC_CLIENT = [
    "store/client/grpc.py",
    "store/client/local.py",
    "store/client/own_session.py",  # the client's session, the view's leases are taken under
    "store/client/view.py",
    "store/client/view_leases.py",
    "store/client/lease_region.py",  # the region's extent map, read for the hit's extents
]
GRPC_SERVER = ["store/client/wire.py", "store/server/grpc.py"]  # a fetch, a peer's lease

DRAM_EMBEDDED = {
    "engine": sorted([*ENGINE, "store/node.py", *STATE_MACHINE]),
    "engine (plumbing)": ["core/chunks.py", "core/keys.py"],
}
DRAM_SERVED = {  # nothing on the store's side: the hit makes no call
    "engine": sorted([*ENGINE, *GRPC_CLIENT]),
    "engine (plumbing)": ["core/chunks.py", "core/keys.py"],
}
REMOTE = {
    "engine": sorted(
        [
            *ENGINE,
            *GRPC_CLIENT,
            "store/client/wire.py",  # the fetch's answer
            "index/api.py",
            "index/client/grpc.py",
            "index/client/wire.py",
            "store/api/remote.py",
            "tiers/remote.py",
        ]
    ),
    "engine (plumbing)": ["core/chunks.py", "core/engine_hint.py", "core/keys.py"],
    # the holder reads its lease's chunks and checksums in place (StoreCore.upkeep)
    "holder": sorted(
        [*GRPC_SERVER, *STATE_MACHINE, "store/remote/fetch.py", "store/state/upkeep.py"]
    ),
    "holder (plumbing)": ["core/auth.py", "core/keys.py", "core/rpc.py"],
    "store": sorted(
        [
            *GRPC_SERVER,
            *STATE_MACHINE,
            # the engine's session, opened by its first leased lookup, with its row of the
            # lease region: the lookup itself is then answered on the engine's side
            "store/client/pin_table.py",
            "store/client/lease_region.py",  # the pulled chunks in the lease region's map
            "store/shared_view.py",  # the pulled chunks' records for the lease region's map
            "store/client/grpc.py",
            "store/client/own_session.py",  # the session its lease of the holder's run is under
            "store/pool/allocator.py",
            "store/remote/directory.py",
            "store/remote/fetch.py",
            "store/remote/mooncake.py",
            "store/remote/peers.py",
            "store/remote/transport.py",
            "store/client/local.py",  # its client of the holder (whose node-local path is off)
            "store/client/proof.py",  # the holder proves a node credential before the token
            "store/client/view.py",  # the pulled chunks' commit, in the node's shared view
            "store/state/eventlog.py",
            "store/state/quotas.py",
            "store/state/upkeep.py",  # the run's chunks already here, pinned and unpinned
        ]
    ),
    "store (plumbing)": ["core/auth.py", "core/keys.py", "core/rpc.py"],
}


# -- the recorder -----------------------------------------------------------------------------


@dataclass
class Recorder:
    """A profile hook (every thread started after ``install``, and the main thread inside the
    traced hooks) that notes which product files run while the window is open."""

    open: bool = False
    store_sides: dict[int, str] = field(default_factory=dict)  # store epoch -> side
    files: dict[str, set[str]] = field(default_factory=dict)  # side -> files
    # per thread: the store gRPC handlers running (frame, side, RPC name), innermost last
    _handlers: dict[int, list[tuple[FrameType, str, str]]] = field(default_factory=dict)

    def install(self) -> None:
        threading.setprofile(self.hook)

    def uninstall(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.open or event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(PREFIX):
            return
        rel = path[len(PREFIX) :]
        stack = self._handlers.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
            return
        if rel == "core/rpc.py" and frame.f_code.co_name == "wrapper":  # rpc.handler's
            servicer, method = frame.f_locals.get("self"), frame.f_locals.get("method")
            if type(servicer).__name__ == "StoreServicer" and method is not None:
                side = self.store_sides.get(servicer.epoch)  # type: ignore[union-attr]
                if side is not None:
                    stack.append((frame, side, method.__name__))
        if rel == "store/server/control.py" and frame.f_code.co_name == "_answer":
            from kvtier.store.server.control import OPS  # the control socket's requests

            server, op = frame.f_locals.get("self"), frame.f_locals.get("op")
            side = self.store_sides.get(server.servicer.epoch)  # type: ignore[union-attr]
            if side is not None and op in OPS:
                stack.append((frame, side, OPS[op][0]))
        if rel.startswith(NOT_PRODUCT) or "_pb2" in rel:
            return
        name = threading.current_thread().name
        if stack:
            _, side, rpc = stack[-1]
            if rpc in BACKGROUND_RPCS:
                return
        elif name == "MainThread" or name.startswith(ENGINE_THREADS):
            side = "engine"
        else:
            return  # the stores' and the index's background threads, gRPC's pollers
        if rel.startswith(PLUMBING):
            side = f"{side} (plumbing)"
        self.files.setdefault(side, set()).add(rel)

    def lists(self) -> dict[str, list[str]]:
        return {side: sorted(files) for side, files in sorted(self.files.items())}

    @contextmanager
    def main_thread(self) -> Iterator[None]:
        sys.setprofile(self.hook)
        try:
            yield
        finally:
            sys.setprofile(None)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    rec.install()  # before any store or engine thread starts
    try:
        yield rec
    finally:
        rec.open = False
        rec.uninstall()


def trace_hooks(rig: Any, recorder: Recorder) -> None:
    """Record the main thread inside the hooks that carry a hit; the first lookup opens the
    window (``load_step`` closes it)."""

    def traced(obj: Any, name: str, opens: bool = False) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def hook(*args: Any, **kwargs: Any) -> Any:
            if opens:
                recorder.open = True
            if not recorder.open:
                return inner(*args, **kwargs)
            with recorder.main_thread():
                return inner(*args, **kwargs)

        setattr(obj, name, hook)

    traced(rig.connector, "get_num_new_matched_tokens", opens=True)
    traced(rig.connector, "update_state_after_alloc")
    traced(rig.worker, "start_load_kv")
    traced(rig.worker, "wait_for_layer_load")


def load_step(rig: Any, req_id: str, timeout_s: float = 20.0) -> int:
    """Step until ``req_id`` is scheduled past its hit (the step that copies it); returns the
    tokens it started from (0: it was scheduled without a hit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = rig.step()
        if req_id in report.starts:
            return int(report.starts[req_id])
        time.sleep(0.005)  # the lookup runs on its thread ("ask again" meanwhile)
    raise AssertionError(f"{req_id} was never scheduled")


def settle(rig: Any, core: Any, chunks: int) -> None:
    """Until the store holds ``chunks`` checksummed chunks and the rig's threads are idle:
    nothing of the first request runs while the hit is traced."""
    deadline = time.monotonic() + 10
    while core.stats()["chunks"] < chunks or core.upkeep.unsummed_count():
        assert time.monotonic() < deadline, f"the store never held {chunks} checksummed chunks"
        if rig.scheduler.has_requests():  # a finished request held for a save sent late
            rig.step()
        time.sleep(0.01)
    sched = rig.connector.scheduler
    for executor in (sched.lookups.executor, sched._ops, sched._alloc):
        executor.submit(lambda: None).result()


def report(title: str, lists: dict[str, list[str]]) -> None:
    print(f"\n{title}")
    for side, files in lists.items():
        print(f"  {side}: {len(files)}")
        for path in files:
            print(f"    {path}")


def _rig(tmp_path: Path, **extra: Any) -> Any:
    """An engine of one tiny model (made once under ``tmp_path``'s parent: every node runs the
    same, or they would share no namespace)."""
    from kvtier.testing.models import make_tiny_llama

    from support.engine_rig import EngineRig

    model = tmp_path.parent / "model"
    if not model.exists():
        make_tiny_llama(model, num_layers=2)
    tmp_path.mkdir(exist_ok=True)
    return EngineRig(tmp_path, chunk_tokens=CHUNK, extra=extra, model=model)


def _store(sockets: Path, node_id: str, **fields: Any) -> Any:
    """A served store in this process, its run dir (its control socket) under ``sockets`` (a
    short path: ``short_tmp``). Sessions time out in a minute: no heartbeat runs while a hit
    is traced (they are not recorded anyway)."""
    from kvtier.core.config import StoreConfig
    from kvtier.store.server.service import StoreService

    run_dir = sockets / f"run-{node_id}"
    run_dir.mkdir()
    config = StoreConfig(
        node_id=node_id,
        grpc_host="127.0.0.1",
        grpc_port=0,
        http_host="127.0.0.1",
        http_port=0,
        run_dir=run_dir,
        session_timeout_s=60.0,
        pool={"capacity": 16 << 20, "page_size": 64 << 10},
        **fields,
    )
    return StoreService.start(config)


# -- the requests ----------------------------------------------------------------------------


def dram_hit(
    tmp_path: Path, sockets: Path, recorder: Recorder, served: bool
) -> dict[str, list[str]]:
    service = _store(sockets, "node-a") if served else None
    rig = _rig(tmp_path / "a", **({"store_address": service.grpc_address} if service else {}))
    try:
        core = service.node.core if service else rig.connector.scheduler.pool.store.core
        if service is not None:
            recorder.store_sides[service.node.epoch] = "store"
        rig.add("first", PROMPT)
        rig.run()
        settle(rig, core, 4)
        assert rig.scheduler.kv_cache_manager.reset_prefix_cache()  # no device hit: DRAM
        trace_hooks(rig, recorder)
        rig.add("hit", PROMPT)
        assert load_step(rig, "hit") == 4 * CHUNK
        recorder.open = False
        rig.run()
        assert rig.wrong == []  # the 128 tokens loaded are exactly their KV
    finally:
        recorder.open = False
        rig.close()
        if service is not None:
            service.stop()
    return recorder.lists()


def test_a_dram_hit_from_an_embedded_store(
    tmp_path: Path, short_tmp: Path, recorder: Recorder
) -> None:
    lists = dram_hit(tmp_path, short_tmp, recorder, served=False)
    report("DRAM hit, embedded store", lists)
    assert lists == DRAM_EMBEDDED


def test_a_dram_hit_from_a_served_store(
    tmp_path: Path, short_tmp: Path, recorder: Recorder
) -> None:
    lists = dram_hit(tmp_path, short_tmp, recorder, served=True)
    report("DRAM hit, served store", lists)
    assert lists == DRAM_SERVED


@pytest.mark.remote
def test_a_remote_hit(tmp_path: Path, short_tmp: Path, recorder: Recorder) -> None:
    from kvtier.core.chunks import Tier
    from kvtier.core.config.index import IndexConfig
    from kvtier.index.server.service import IndexService

    index = IndexService.start(
        IndexConfig(grpc_host="127.0.0.1", grpc_port=0, http_host="127.0.0.1", http_port=0)
    )
    remote = {"enabled": True, "fetch_timeout_s": 5.0}
    holder = _store(short_tmp, "node-b", remote=remote, index_address=index.grpc_address)
    local = _store(short_tmp, "node-a", remote=remote, index_address=index.grpc_address)
    recorder.store_sides[local.node.epoch] = "store"
    recorder.store_sides[holder.node.epoch] = "holder"
    rigs = []
    try:
        producer = _rig(tmp_path / "b", store_address=holder.grpc_address)  # node B's engine
        rigs.append(producer)
        producer.add("first", PROMPT)
        producer.run()
        settle(producer, holder.node.core, 4)
        deadline = time.monotonic() + 20
        while True:  # the index follows node B's events
            held = {i.registration.location: i.entries for i in index.backend.locations()}
            if held.get("node-b", {}).get(Tier.CPU, 0) >= 4:
                break
            assert time.monotonic() < deadline, "the index never learnt node B's chunks"
            time.sleep(0.05)
        rig = _rig(  # node A's engine: its store is empty, the index says node B holds the run
            tmp_path / "a",
            store_address=local.grpc_address,
            index_address=index.grpc_address,
            tiers=["cpu", "remote"],
            min_hit_tokens={"cpu": CHUNK, "remote": CHUNK},
            remote_fetch_timeout_s=5.0,  # first contact with node B: no recompute on a slow box
            lookup_deadline_s=15.0,
        )
        rigs.append(rig)
        assert local.node.core.stats()["chunks"] == 0
        trace_hooks(rig, recorder)
        rig.add("hit", PROMPT)
        assert load_step(rig, "hit") == 4 * CHUNK
        deadline = time.monotonic() + 5
        while holder.node.core.stats()["read_leases"]:  # the fetch's lease at the holder
            assert time.monotonic() < deadline, "the holder's lease never ended"
            time.sleep(0.005)
        recorder.open = False
        rig.run()
        assert rig.wrong == []
        assert local.node.core.stats()["chunks"] == 4  # pulled from node B, then loaded
    finally:
        recorder.open = False
        for r in rigs:
            r.close()
        local.stop()
        holder.stop()
        index.stop()
    lists = recorder.lists()
    report("remote hit", lists)
    assert lists == REMOTE


# -- the design doc says the same ------------------------------------------------------------

CASES = {"DRAM, embedded": DRAM_EMBEDDED, "DRAM, served": DRAM_SERVED, "remote": REMOTE}
SIDES = {"E": "engine", "S": "store", "H": "holder"}


def test_the_design_doc_pins_the_same_files() -> None:
    """docs/design.md's table (one row per file, a column per case, E / S / H for the side
    that runs it) says exactly what the lists above say."""
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc.split("## One request, file by file", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| `[a-z_/]+\.py` \|", line)]
    header = next(line for line in section.splitlines() if line.startswith("| file |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    from_doc: dict[str, dict[str, list[str]]] = {case: {} for case in CASES}
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
        path = cells["file"].strip("`")
        for case in CASES:
            for letter in cells[case].split():
                side = SIDES[letter]
                if path.startswith(PLUMBING):
                    side = f"{side} (plumbing)"
                from_doc[case].setdefault(side, []).append(path)
    for case, pinned in CASES.items():
        got = {side: sorted(files) for side, files in sorted(from_doc[case].items())}
        assert got == pinned, case
