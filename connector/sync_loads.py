"""A step's sync loads, layer by layer on one thread (``kvtier-load``), so a layer's attention
can start while later layers copy (different layers, never the same pages at once).

The model-runner thread maps and holds each job's pool and starts the thread
(``ConnectorWorker.start_load_kv``); the thread copies layer after layer and sets that layer's
event, which ``wait_for_layer`` (vLLM's ``wait_for_layer_load``, model-runner thread) waits for
before ordering the compute stream after the layer's copies. ``join`` ends the step's loads
(the worker's ``save``, vLLM's ``wait_for_save``): every verdict (loaded, failed) is in before
vLLM takes the step's load errors.

Checksums (``verify_loads``): on CUDA, where a chunk holds at least
``LAYERWISE_MIN_SLICE_BYTES`` a layer, hashing threads follow the copies layer by layer
(``load_sums.LayerwiseSums``); elsewhere the last layer's ``_run_load`` hashes the chunks
after all copies ended. Either way a load is reported done or failed, never neither, and no
hashing thread outlives the step's pools.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvtier.connector.load_sums import LayerwiseSums
from kvtier.connector.metadata import LoadJob
from kvtier.connector.paged_kv import CopyPlan, PoolView

if TYPE_CHECKING:
    from kvtier.connector.worker import ConnectorWorker

# A CUDA sync load's checksums follow its copies layer by layer where a chunk holds at least
# this much per layer; below, the per-layer waits and GIL hand-offs cost more than the overlap
# hides, and the chunks are hashed after the copies (H200: MLA's 288 KiB a layer 32.4 ms
# against 19.5; 1 MiB a layer 36.8 against 50.2 at 8k tokens: docs/benchmarks.md)
LAYERWISE_MIN_SLICE_BYTES = 512 << 10


class SyncLoads:
    """One worker's sync loads (its ``_run_load``, ``_fail_load`` and ``_drain_loads`` do the
    copying and the reporting)."""

    def __init__(self, worker: ConnectorWorker) -> None:
        self.worker = worker
        self._ready = [threading.Event() for _ in worker.geometry.layer_names]
        self._thread: threading.Thread | None = None

    def start(self, jobs: list[LoadJob], pools: dict[str, PoolView | None]) -> None:
        """Model-runner thread: copy ``jobs`` through ``pools`` (held for them) on the load
        thread."""
        for event in self._ready:
            event.clear()
        self._thread = threading.Thread(
            target=self._load_layers, args=(jobs, pools), name="kvtier-load", daemon=True
        )
        self._thread.start()

    def release_layers(self) -> None:
        """Never leave the forward waiting (the loads could not start)."""
        for event in self._ready:
            event.set()

    def wait_for_layer(self, layer_name: str) -> None:
        if self._thread is None:
            return
        layer = self.worker._layer_index.get(layer_name)
        if layer is None:
            return
        self._ready[layer].wait()
        kv = self.worker.kv
        assert kv is not None
        kv.wait_layer(layer)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _load_layers(self, jobs: list[LoadJob], pools: dict[str, PoolView | None]) -> None:
        """The ``kvtier-load`` thread: copies through ``pools`` (mapped and held for it by
        the model-runner thread), never touches the worker's mappings."""
        worker = self.worker
        sums: dict[str, LayerwiseSums] = {}
        try:
            plans: dict[str, CopyPlan | None] = {}
            for job in jobs:  # once per job for all layers; a failure fails that job only
                plans[job.req_id] = None
                chunks = job.chunks.get(worker.rank, [])
                failed = job.failed or job.req_id in worker._out.load_failed
                if worker.kv is not None and chunks and not failed:
                    try:
                        plans[job.req_id] = worker.kv.plan(chunks)
                    except Exception as exc:
                        worker._fail_load(job, repr(exc))
            sums = self._layerwise_sums(jobs, pools)
            last = worker.geometry.num_layers - 1
            for layer in range(worker.geometry.num_layers):
                for job in jobs:
                    if job.req_id not in worker._out.load_failed:
                        final = layer == last and job.req_id not in sums
                        worker._run_load(job, plans[job.req_id], (layer,), final, pools[job.req_id])
                if sums:
                    self._mark_issued(layer, jobs, sums)
                self._ready[layer].set()
            if sums:
                self._finish_layerwise(jobs, pools, plans, sums)
        finally:
            for job_sums in set(sums.values()):
                job_sums.abandon()  # its threads end before the pools may go
            self.release_layers()

    def _layerwise_sums(
        self, jobs: list[LoadJob], pools: dict[str, PoolView | None]
    ) -> dict[str, LayerwiseSums]:
        """On CUDA, the verified loads' checksums taken as the copies end, where a chunk's
        layers are large enough for that to pay; else {} (checked after the last layer)."""
        worker, geo = self.worker, self.worker.geometry
        if worker.kv is None or not worker.kv.is_cuda:
            return {}  # a CPU copy has ended when it is issued
        if geo.chunk_bytes // geo.num_layers < LAYERWISE_MIN_SLICE_BYTES:
            return {}
        loads = {}
        for job in jobs:
            pool, chunks = pools.get(job.req_id), job.chunks.get(worker.rank, [])
            failed = job.req_id in worker._out.load_failed
            if job.verify and pool is not None and chunks and not failed:
                loads[job.req_id] = (chunks, pool.segment.array)
        if not loads:
            return {}
        threads = worker.verify_threads()
        executor = worker._verifiers.pool(threads, always=True)
        assert executor is not None
        sums = LayerwiseSums(loads, geo, executor, threads)
        return dict.fromkeys(loads, sums)

    def _mark_issued(self, layer: int, jobs: list[LoadJob], sums: dict[str, LayerwiseSums]) -> None:
        """Tell the hashing threads layer ``layer``'s copies are issued (an event after
        them); if that fails, the layer-wise loads fail."""
        kv = self.worker.kv
        assert kv is not None
        try:
            mark = kv.ordering.loads_issued()
        except Exception as exc:
            self._fail_layerwise(jobs, sums, exc)
            mark = None
        for job_sums in set(sums.values()):
            job_sums.layer_issued(layer, mark)

    def _finish_layerwise(
        self,
        jobs: list[LoadJob],
        pools: dict[str, PoolView | None],
        plans: dict[str, CopyPlan | None],
        sums: dict[str, LayerwiseSums],
    ) -> None:
        """Every layer issued: wait for the checksums, then end each such load as the last
        layer's ``_run_load`` ends the others (copies waited for, store alive, verified)."""
        worker = self.worker
        try:
            for job_sums in set(sums.values()):
                job_sums.finish()
        except Exception as exc:
            self._fail_layerwise(jobs, sums, exc)
        for job in jobs:
            if job.req_id in sums and job.req_id not in worker._out.load_failed:
                pool = pools[job.req_id]
                worker._run_load(job, plans[job.req_id], (), True, pool, sums[job.req_id])

    def _fail_layerwise(
        self, jobs: list[LoadJob], sums: dict[str, LayerwiseSums], exc: Exception
    ) -> None:
        for job in jobs:
            if job.req_id in sums and job.req_id not in self.worker._out.load_failed:
                self.worker._fail_load(job, repr(exc))
        self.worker._drain_loads()
