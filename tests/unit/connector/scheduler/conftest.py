"""A rig for unit tests of the connector's scheduler side (``connector/scheduler.py``).

``ConnectorScheduler`` is driven hook by hook in the order vLLM 0.32's scheduler calls it
(``vllm/v1/core/sched/scheduler.py``; ``KvtierConnector`` only translates the arguments):

1. ``schedule()``, for each waiting request: ``get_num_new_matched_tokens(request,
   local_hit)`` with vLLM's block-aligned prefix-cache hit. ``None`` means "ask again": the
   request stays waiting this step and is asked again in the next one.
2. the same request, once ``allocate_slots`` found it blocks: ``update_state_after_alloc(
   request, block_ids, num_external_tokens)``. No blocks: nothing is called, the request stays
   waiting (step 1 again next step). An async load then waits in WAITING_FOR_REMOTE_KVS.
3. the end of ``schedule()``, once per step: ``build_connector_meta(scheduler_output)``
   (``build_meta``): each scheduled request (id, tokens computed before the step, tokens
   this step) and the ids preempted in this ``schedule()``; a preemption calls no other hook.
   vLLM then advances each scheduled request's ``num_computed_tokens``.
4. the workers, in the model runner's order: ``start_load_kv``; per layer
   ``wait_for_layer_load``, the layer's forward, ``save_kv_layer``; ``wait_for_save``;
   ``get_finished(finished_req_ids)`` (the requests that finished since the last step);
   ``get_block_ids_with_load_errors``; ``build_connector_worker_meta``.
5. ``update_from_output``: vLLM rewinds the requests owning ``invalid_block_ids`` (they
   recompute from the first one), frees each request that stopped this step
   (``request_finished``: True = hold its blocks), then ``update_connector_output(
   KVConnectorOutput)`` (``on_worker_output``), then ``finished_recving`` /
   ``finished_sending`` (a held request's blocks are freed).

An abort (``finish_requests``) calls ``request_finished`` between steps, whatever the request
is doing. ``Rig.step`` runs 3-5; tests that need to look between two hooks call them one by
one.

What is real: the scheduler side, a node store running in this process over a small
shared-memory pool (``Store`` wraps it to produce faults only a store can: a stall, a restart),
and ``ConnectorWorker`` copying between that pool and a paged CPU KV cache. What stands in:
vLLM's block manager (block ids handed out per request; its prefix cache is only the set of
blocks the connector evicted from it, ``Rig.evicted``) and the model: each computed page is a
digest of its tokens, and a step that attends to a page not holding its tokens' KV computes
garbage (``Rig.wrong``), as the real model would. ``Rig.stored`` reads the pool and fails on
any chunk whose bytes are not exactly its tokens' KV.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.connector.request_state import RequestState
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.connector.worker import ConnectorWorker
from kvtier.core.config import StoreConfig
from kvtier.core.config.connector import ConnectorConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.api import StoreClient, StoreInfo
from kvtier.store.client import connect as connect_store
from kvtier.tiers import CpuTier, Tiers

BLOCK = 16  # tokens per KV block
CHUNK = 32  # tokens per chunk: two blocks
PAGE = 1024  # bytes of one layer's page of one block
LAYERS = ("l0", "l1")
NUM_BLOCKS = 512
GEOMETRY = KvGeometry(LAYERS, BLOCK, PAGE, CHUNK, "unit-pages")  # a chunk: 4 KiB, one pool page
IDENTITY = ModelIdentity("unit-model", "", "float32", 1, 1, tp_size=1, pp_size=1)

Scheduled = tuple[Request, int, int]  # (request, tokens computed before the step, this step)


def until(check: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.005)


def page(layer: int, tokens: Sequence[int]) -> np.ndarray:
    """The stand-in model's page of ``layer`` for the block ending ``tokens``."""
    seed = hashlib.blake2b(repr((layer, list(tokens))).encode(), digest_size=64).digest()
    return np.frombuffer(seed * (PAGE // 64), dtype=np.uint8)


def chunk_bytes(tokens: Sequence[int], chunk: int) -> bytes:
    """What chunk ``chunk`` of ``tokens`` must hold in the pool: layer after layer, the pages of
    its blocks (``connector/layout.py``)."""
    per = CHUNK // BLOCK
    blocks = range(chunk * per, (chunk + 1) * per)
    return b"".join(
        page(layer, tokens[: (b + 1) * BLOCK]).tobytes()
        for layer in range(len(LAYERS))
        for b in blocks
    )


class Store(StoreClient):
    """A node store in this process behind the store API, with the faults only a store makes.

    ``served``: the connector sees a store in another process (no local segment), so it runs
    lookups, allocations, commits and releases on its threads, as with a gRPC store.
    ``stall(method)``: that call waits until the returned event is set (a loaded store).
    ``restart()``: the store stops and a new incarnation starts (new epoch, new segment, no
    leases); as with the gRPC client, every call answers STALE_EPOCH until ``reattach``.
    ``inner`` is the store itself, for the tests' own reads (never stalled)."""

    def __init__(self, config: StoreConfig, served: bool) -> None:
        self.config = config
        self.served = served
        self.inner: Any = connect_store(config)  # no address: the store itself, in-process
        self.calls: Counter[str] = Counter()
        self._stalls: dict[str, threading.Event] = {}
        self._stale = False

    def stall(self, method: str) -> threading.Event:
        gate = threading.Event()
        self._stalls[method] = gate
        return gate

    def unstall(self) -> None:
        for gate in self._stalls.values():
            gate.set()

    def restart(self) -> None:
        self.inner.close()  # its segment is unlinked, its leases are gone
        self.inner = connect_store(self.config)
        self._stale = True

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        gate = self._stalls.get(method)
        if gate is not None:
            gate.wait(30)
        if self._stale:
            raise KvtierError(ErrorCode.STALE_EPOCH, "the store restarted")
        self.calls[method] += 1
        return getattr(self.inner, method)(*args, **kwargs)

    # -- StoreClient -------------------------------------------------------------------------

    def info(self) -> StoreInfo:
        return self.inner.info()

    def local_segment(self) -> Any:
        return None if self.served else self.inner.local_segment()

    def reattach(self) -> StoreInfo:
        self._stale = False
        return self.inner.info()

    def register_namespace(self, namespace: Any, chunk_bytes: int) -> bytes:
        return self._call("register_namespace", namespace, chunk_bytes)

    def lookup(self, ns_id: bytes, keys: Any, lease_ttl_s: Any = None, *, session: int = 0) -> Any:
        return self._call("lookup", ns_id, keys, lease_ttl_s, session=session)

    def allocate(
        self, ns_id: bytes, keys: Any, sizes: Any, ttl_s: Any = None, *, session: int = 0
    ) -> Any:
        return self._call("allocate", ns_id, keys, sizes, ttl_s, session=session)

    def commit(
        self,
        lease_id: int,
        keys: Any,
        checksums: Any,
        *,
        as_ns_id: bytes = b"",
        as_keys: Any = None,
    ) -> int:
        return self._call("commit", lease_id, keys, checksums, as_ns_id=as_ns_id, as_keys=as_keys)

    def abort(self, lease_id: int, keys: Any = None) -> int:
        return self._call("abort", lease_id, keys)

    def release(self, lease_ids: Any) -> Any:
        return self._call("release", lease_ids)

    def renew(self, lease_id: int, ttl_s: Any = None) -> float:
        return self._call("renew", lease_id, ttl_s)

    def open_session(self) -> int:
        return self._call("open_session")

    def heartbeat(self, session: int) -> bool:
        return self._call("heartbeat", session)

    def close_session(self, session: int) -> int:
        return self._call("close_session", session)

    def delete(self, ns_id: bytes, keys: Any) -> int:
        return self._call("delete", ns_id, keys)

    def clear(self) -> int:
        return self._call("clear")

    def stats(self) -> Any:
        return self.inner.stats()

    def snapshot(self) -> Any:
        return self.inner.snapshot()

    def read_events(self, from_seq: int, max_batches: int = 256, timeout: Any = None) -> Any:
        return self.inner.read_events(from_seq, max_batches, timeout)

    def close(self) -> None:
        self.unstall()
        self.inner.close()


@dataclass
class Step:
    """One engine step as the rig ran it."""

    meta: KvtierMetadata  # what build_meta sent the workers
    worker_meta: KvtierWorkerMetadata | None  # what the workers reported
    invalid_block_ids: set[int]  # the workers' load errors (vLLM recomputes these blocks)
    finished_sending: set[str]
    finished_recving: set[str]
    held: dict[str, bool] = field(default_factory=dict)  # request_finished's answers


class Rig:
    BLOCK = BLOCK
    CHUNK = CHUNK

    def __init__(
        self,
        run_dir: Path,
        *,
        served: bool = False,
        capacity: int = 1 << 20,
        store: dict[str, Any] | None = None,
        **connector: Any,
    ) -> None:
        """``connector``: ``[connector]`` settings over the rig's (32-token chunks, hits from
        one chunk on); ``store``: ``[store]`` settings; ``capacity``: the pool's bytes (one
        4 KiB page a chunk)."""
        self.config = ConnectorConfig(
            **{"chunk_tokens": CHUNK, "min_hit_tokens": {"cpu": CHUNK}, **connector}
        )
        self.store = Store(
            StoreConfig(
                node_id="unit",
                run_dir=run_dir,
                pool={"capacity": capacity, "page_size": 4096, "prefault": False},
                **(store or {}),
            ),
            served,
        )
        self.pool = CpuTier(self.store, segment=self.store.local_segment())
        self.sched = ConnectorScheduler(self.config, GEOMETRY, IDENTITY, Tiers(self.pool))
        self.evicted: set[int] = set()  # blocks the connector took out of vLLM's prefix cache
        self.blocks: dict[str, list[int]] = {}  # vLLM's block table
        self._next_block = 1  # block 0 is vLLM's null block, never a request's
        self.sched.bind_blocks(lambda req_id: (self.blocks[req_id],), 0, self.evicted.update)
        self.kv = {name: torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.uint8) for name in LAYERS}
        self.worker = ConnectorWorker(self.config, GEOMETRY, 0)
        self.worker.register_kv_caches(self.kv)
        self.wrong: set[str] = set()  # requests that computed over pages not holding their KV
        self.counters: dict[str, float] = {}
        self._finished_since_step: set[str] = set()
        self._seeds = 0

    # -- requests and blocks -----------------------------------------------------------------

    @staticmethod
    def request(req_id: str, tokens: Iterable[int]) -> Request:
        return Request(req_id, list(tokens), SamplingParams(max_tokens=1), None)

    def allocate(self, request: Request, shared: Sequence[int] = ()) -> list[int]:
        """vLLM's ``allocate_slots`` for the whole prompt: ``shared`` blocks first (a
        prefix-cache hit on another request's blocks), new ones after."""
        n = -(-request.num_tokens // BLOCK) - len(shared)
        ids = [*shared, *range(self._next_block, self._next_block + n)]
        self._next_block += n
        assert self._next_block <= NUM_BLOCKS
        self.blocks[request.request_id] = ids
        return ids

    def page_of(self, block_id: int, layer: int = 0) -> np.ndarray:
        return self.kv[LAYERS[layer]].numpy()[block_id]

    # -- the hooks, in vLLM's order ----------------------------------------------------------

    def lookup(self, request: Request, local_hit: int = 0, timeout: float = 5.0) -> int:
        """Hook 1, asked again each step until the connector answers (a served store's lookup
        runs on a thread)."""
        deadline = time.monotonic() + timeout
        while True:
            hit, _ = self.sched.get_num_new_matched_tokens(request, local_hit)
            if hit is not None:
                return hit
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.005)

    def admit(self, request: Request, local_hit: int = 0) -> int:
        """Hooks 1-2 for a waiting request vLLM finds blocks for: the tokens it counts as
        loaded."""
        hit = self.lookup(request, local_hit)
        self.sched.update_state_after_alloc(request, (self.allocate(request),), hit)
        return hit

    def build(self, scheduled: Sequence[Scheduled] = (), preempted: Iterable[Request] = ()):
        """Hook 3 (the end of ``schedule()``), then vLLM advances the scheduled requests."""
        meta = self.sched.build_meta(
            [(r.request_id, start, count) for r, start, count in scheduled],
            {r.request_id for r in preempted},
        )
        for r, start, count in scheduled:
            r.num_computed_tokens = start + count
        return meta

    def run_workers(self, meta: KvtierMetadata, scheduled: Sequence[Scheduled] = ()) -> Step:
        """The worker's hooks (4) around the stand-in model's forward."""
        worker = self.worker
        worker.start_load_kv(meta)
        for layer, name in enumerate(LAYERS):
            worker.wait_for_layer_load(name)
            for request, start, count in scheduled:
                self._compute(layer, request, start, count)
            worker.save_layer(meta, name)
        worker.save(meta)
        finished, self._finished_since_step = self._finished_since_step, set()
        sending, recving = worker.get_finished(finished)
        errors = worker.get_block_ids_with_load_errors()
        return Step(meta, worker.take_worker_meta(), errors, sending or set(), recving or set())

    def finish(self, request: Request) -> bool:
        """``request_finished``: the request stopped or was aborted. True: vLLM holds its
        blocks until the workers report it finished sending."""
        self._finished_since_step.add(request.request_id)
        return self.sched.request_finished(request.request_id)

    def output(self, step: Step, scheduled: Sequence[Scheduled] = (), finished=()) -> Step:
        """Hook 5: vLLM rewinds requests over failed blocks, frees the finished ones, then hands
        the connector the workers' output."""
        for request, _, _ in scheduled:
            blocks = self.blocks[request.request_id]
            bad = [i for i, b in enumerate(blocks) if b in step.invalid_block_ids]
            if bad:
                request.num_computed_tokens = min(request.num_computed_tokens, bad[0] * BLOCK)
        step.held = {r.request_id: self.finish(r) for r in finished}
        self.sched.on_worker_output(step.worker_meta)
        return step

    def step(
        self,
        scheduled: Sequence[Scheduled] = (),
        *,
        preempted: Iterable[Request] = (),
        finished: Sequence[Request] = (),
        before_workers: Callable[[KvtierMetadata], None] | None = None,
    ) -> Step:
        """Hooks 3-5: one engine step. ``finished``: requests that stop in this step (their
        last token sampled); ``before_workers(meta)``: a fault injected before the copies."""
        meta = self.build(scheduled, preempted)
        if before_workers is not None:
            before_workers(meta)
        return self.output(self.run_workers(meta, scheduled), scheduled, finished)

    # -- the stand-in model ------------------------------------------------------------------

    def _compute(self, layer: int, request: Request, start: int, count: int) -> None:
        tokens = list(request.all_token_ids)
        blocks = self.blocks[request.request_id]
        rows = self.kv[LAYERS[layer]].numpy()
        attended = range(start // BLOCK)
        bad = any(
            not np.array_equal(rows[blocks[b]], page(layer, tokens[: (b + 1) * BLOCK]))
            for b in attended
        )
        if bad:
            self.wrong.add(request.request_id)
        end = start + count
        for b in range(start // BLOCK, -(-end // BLOCK)):
            upto = tokens[: min((b + 1) * BLOCK, end)]
            rows[blocks[b]] = page(layer, [-1, *upto] if bad else upto)

    # -- what the store holds ----------------------------------------------------------------

    def keys(self, tokens: Sequence[int]) -> tuple[bytes, list[bytes]]:
        """The namespace id and the chunk keys of ``tokens``' whole chunks (this instance's
        namespace as it is now)."""
        state = RequestState.of(self.request("probe", tokens), self.sched.identity.generation)
        ns_id = self.sched.resolver.namespaces(state)[0]
        return ns_id, state.keys(0, len(tokens) // CHUNK, CHUNK)

    def held(self, tokens: Sequence[int]) -> list[int]:
        """Which chunks of ``tokens`` the pool holds, wherever they are in the prompt; fails if
        one of them holds anything but exactly its tokens' KV."""
        ns_id, keys = self.keys(tokens)
        out = []
        for i, key in enumerate(keys):
            data = self.pool.get(ns_id, [key])  # a read lease, given back at once
            if data:
                assert data[0] == chunk_bytes(tokens, i), f"the pool's chunk {i} holds wrong KV"
                out.append(i)
        return out

    def stored(self, tokens: Sequence[int]) -> int:
        """How many leading chunks of ``tokens`` the pool holds (each checked by ``held``)."""
        held = self.held(tokens)
        return next((n for n, i in enumerate(held) if n != i), len(held))

    def settle(self, tokens: Sequence[int]) -> None:
        """Wait until the store checksummed the committed chunks of ``tokens`` (it does so off
        the writer's path; with ``verify_loads`` a lookup's run stops before unsummed ones)."""
        ns_id, keys = self.keys(tokens)

        def summed() -> bool:
            hits = self.pool.lookup(ns_id, keys).hits
            return bool(hits) and all(h.checksum for h in hits)

        until(summed, what="checksums")

    def seed(self, tokens: Sequence[int]) -> None:
        """A request computes ``tokens`` in one step and finishes; its chunks are committed
        and checksummed. The counters start again from zero after it."""
        self._seeds += 1
        request = self.request(f"seed{self._seeds}", tokens)
        assert self.admit(request) == 0
        self.step([(request, 0, len(tokens))], finished=[request])
        self.steps_until(lambda: self.stored(tokens) == len(tokens) // CHUNK, "the seed")
        self.settle(tokens)
        self.counts()
        self.counters.clear()  # tests count what follows the seed

    until = staticmethod(until)

    def steps_until(self, check: Callable[[], bool], what: str = "", timeout: float = 5.0):
        """Empty engine steps until ``check()``: a served store's late answers (pool space)
        are used in later steps."""
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
            self.step()
            time.sleep(0.005)

    def read_leases(self) -> int:
        return int(self.store.inner.stats()["read_leases"])

    def write_leases(self) -> int:
        """Write leases of saves: all the store has, less those of the space the connector
        holds ahead (``SaveSlab``: held on purpose, and given back at shutdown)."""
        slab = self.sched.saves.slab
        held = len(slab.lease_ids()) if slab is not None else 0
        return int(self.store.inner.stats()["write_leases"]) - held

    def writing_bytes(self) -> int:
        """Pages being written by saves (less the space held ahead, as ``write_leases``)."""
        slab = self.sched.saves.slab
        held = slab.held() * GEOMETRY.chunk_bytes if slab is not None else 0
        return int(self.store.inner.stats()["writing_bytes"]) - held

    def counts(self) -> dict[str, float]:
        """The scheduler's and the worker's counters, summed since the rig started."""
        for data in (self.sched.take_stats(), self.worker.stats.take()):
            for name, value in data.items():
                self.counters[name] = self.counters.get(name, 0) + value
        return self.counters

    def close(self) -> None:
        self.store.unstall()
        self.worker.shutdown()
        self.sched.shutdown()
        self.pool.close()


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """``make_rig(**settings)``: a ``Rig`` (closed after the test)."""
    rigs: list[Rig] = []

    def make(**settings: Any) -> Rig:
        rig = Rig(tmp_path / f"run{len(rigs)}", **settings)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    """An embedded store (the connector calls it inline), sync loads, checksums verified."""
    return make_rig()
