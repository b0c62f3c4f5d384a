"""The worker side of the connector: moves bytes between vLLM's paged KV and the node's pool,
decides nothing.

Each step the scheduler side sends ``LoadJob``s and ``SaveJob``s (``metadata.py``) naming pool
extents and KV block ids. This class copies, verifies when asked, and reports back: loads that
finished (async) or failed (block ids vLLM must recompute), and saves whose bytes are in the
pool (the scheduler then commits them).

Failure rule: any doubt about a load's bytes (segment gone, checksum mismatch, scheduler says
the lease lapsed, an exception mid-copy) makes every block of that load a load error, reported
in the same step; vLLM recomputes them, so a failed load costs time, never a wrong token.

The copies themselves (``PagedKV``: pages, layouts, CPU and CUDA paths) are in
``paged_kv.py``; their ordering against the forward on CUDA in ``streams.py``.

Threading: called from vLLM's model-runner thread; sync loads run layer by layer on one extra
thread (``kvtier-load``) so a layer's attention can start while later layers copy (different
layers, never the same pages at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from kvtier.config_connector import ConnectorConfig
from kvtier.connector.counters import C, Tally
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import (
    KvtierMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    SaveJob,
    SegmentRef,
)
from kvtier.connector.paged_kv import CopyPlan, PagedKV, PoolView
from kvtier.tiers.cpu import checksum_views, map_segment

log = logging.getLogger(__name__)

MAX_MAPPED_SEGMENTS = 4  # a store restart maps a new one; keep a few for jobs in flight


class ConnectorWorker:
    def __init__(self, config: ConnectorConfig, geometry: KvGeometry, tp_rank: int) -> None:
        self.config = config
        self.geometry = geometry
        self.rank = tp_rank
        self.kv: PagedKV | None = None
        self._pools: OrderedDict[str, PoolView] = OrderedDict()
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._out = KvtierWorkerMetadata()
        self.stats = Tally()
        # layer-wise sync loading
        self._layer_ready: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}
        # layer-wise saving, per step
        self._saved_layers: set[int] = set()
        self._failed_saves: set[int] = set()
        self._save_plans: dict[int, CopyPlan] = {}  # job id -> plan, for this step
        # held blocks: requests whose late saves were copied, and requests vLLM said finished
        self._releasing: set[str] = set()
        self._announced: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = PagedKV(kv_caches, self.geometry, self.config.cuda_copy_kernel)
        self._layer_ready = [threading.Event() for _ in self.geometry.layer_names]
        log.info(
            "kvtier worker rank %d: %d layers, %d-byte pages, %d-byte chunks, on %s",
            self.rank,
            self.geometry.num_layers,
            self.geometry.page_bytes,
            self.geometry.chunk_bytes,
            self.kv.device,
        )

    # -- loads -------------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        try:
            if self.kv is not None:  # this is the model runner's thread: its stream orders copies
                self.kv.bind_compute()
            sync_jobs = [job for job in meta.loads if not job.is_async]
            for job in meta.loads:
                if job.is_async:
                    self._run_load(job, None, range(self.geometry.num_layers))
                    self._finished_recving.add(job.req_id)
            if sync_jobs:
                for event in self._layer_ready:
                    event.clear()
                self._load_thread = threading.Thread(
                    target=self._load_layers, args=(sync_jobs,), name="kvtier-load", daemon=True
                )
                self._load_thread.start()
        except Exception as exc:  # never take the engine down: every load of the step fails
            log.exception("kvtier: starting loads failed")
            for job in meta.loads:
                if job.req_id not in self._out.load_failed:
                    self._fail_load(job, repr(exc))
                if job.is_async:
                    self._finished_recving.add(job.req_id)
            for event in self._layer_ready:
                event.set()

    def _load_layers(self, jobs: list[LoadJob]) -> None:
        try:
            plans: dict[str, CopyPlan | None] = {}
            for job in jobs:  # once per job for all layers; a failure fails that job only
                plans[job.req_id] = None
                chunks = job.chunks.get(self.rank, [])
                if self.kv is not None and chunks and not job.failed:
                    try:
                        plans[job.req_id] = self.kv.plan(chunks)
                    except Exception as exc:
                        self._fail_load(job, repr(exc))
            last = self.geometry.num_layers - 1
            for layer in range(self.geometry.num_layers):
                for job in jobs:
                    if job.req_id not in self._out.load_failed:
                        self._run_load(job, plans[job.req_id], (layer,), final=layer == last)
                self._layer_ready[layer].set()
        finally:
            for event in self._layer_ready:
                event.set()  # never leave the forward waiting

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_thread is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        self._layer_ready[layer].wait()
        assert self.kv is not None
        self.kv.wait_layer(layer)

    def _finish_sync_loads(self) -> None:
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None

    def _run_load(
        self,
        job: LoadJob,
        plan: CopyPlan | None,
        layers: range | tuple[int, ...],
        final: bool = True,
    ) -> None:
        if job.failed:
            self._fail_load(job, job.failed)
            return
        chunks = job.chunks.get(self.rank, [])
        if not chunks:
            return
        start = time.perf_counter()
        try:
            assert self.kv is not None, "register_kv_caches was not called"
            if plan is None:
                plan = self.kv.plan(chunks)
            pool = self._pool(job.segments[self.rank])
            if not pool.segment.is_live():
                raise RuntimeError(f"pool segment {pool.segment.name} is no longer the store's")
            for layer in layers:
                self.kv.load_layer(layer, pool, plan)
            if final:
                self.kv.finish_loads()
                # The store incarnation the extents belong to must still be the one serving:
                # a restart mid-copy means the lease that guarded them is gone.
                if not pool.segment.is_live():
                    raise RuntimeError("the store restarted during the copy")
                if job.verify:
                    self._verify(job, pool)
        except Exception as exc:
            self._fail_load(job, repr(exc))
            return
        self.stats.add(C.LOAD_SECONDS, time.perf_counter() - start)
        if final:
            self.stats.add(C.LOADED_CHUNKS, len(chunks))
            self.stats.add(
                C.LOADED_BYTES,
                sum(len(c.block_ids) for c in chunks)
                * self.geometry.page_bytes
                * self.geometry.num_layers,
            )
            self._out.loaded.setdefault(job.req_id, set()).add(self.rank)

    def _verify(self, job: LoadJob, pool: PoolView) -> None:
        """Check every loaded chunk against its checksum; report exactly the bad ones."""
        bad = []
        seen: set[bytes] = set()
        for chunk in job.chunks.get(self.rank, []):
            if chunk.key in seen:
                continue  # a chunk split over several copies: checked once
            seen.add(chunk.key)
            if not chunk.checksum:
                self.stats.add(C.UNVERIFIED_CHUNKS, 1)
                continue
            views = [pool.segment.array[o : o + n] for o, n in chunk.extents]
            if checksum_views(views) != chunk.checksum:
                bad.append(chunk.key)
        if bad:
            self._out.corrupt.setdefault(job.req_id, set()).update((self.rank, k) for k in bad)
            raise ValueError(f"{len(bad)} chunks of request {job.req_id} failed their checksum")

    def _fail_load(self, job: LoadJob, why: str) -> None:
        blocks = job.block_ids(self.rank)
        log.warning(
            "kvtier load for %s failed (%s): %d blocks will be recomputed",
            job.req_id,
            why,
            len(blocks),
        )
        self._load_errors.update(blocks)
        self._out.error_blocks.update(blocks)
        self.stats.add(C.LOAD_ERROR_BLOCKS, len(blocks))
        self._out.load_failed.setdefault(job.req_id, set()).add(self.rank)

    # -- saves -------------------------------------------------------------------------------

    def save_layer(self, meta: KvtierMetadata, layer_name: str) -> None:
        """Right after a layer's forward: its pages of the chunks this step completes are final,
        so copy them now (on CUDA the copy overlaps the next layers' compute)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves:
            return
        for job in meta.saves:
            self._save_job_layer(job, layer)
        self._saved_layers.add(layer)

    def save(self, meta: KvtierMetadata) -> None:
        """End of the step (wait_for_save): copy the layers ``save_layer`` did not see, wait for
        the copies, report. The scheduler commits a chunk when every rank reported it."""
        self._finish_sync_loads()
        try:
            for job in meta.saves:
                if not job.chunks.get(self.rank):
                    continue
                for layer in range(self.geometry.num_layers):
                    if layer not in self._saved_layers:
                        self._save_job_layer(job, layer)
            if self.kv is not None:
                self.kv.finish_saves()
        except Exception as exc:
            log.warning("kvtier: waiting for saves failed: %r", exc)
            self._failed_saves.update(job.job_id for job in meta.saves)
        for job in meta.saves:
            chunks = job.chunks.get(self.rank, [])
            if not chunks:
                continue
            if job.job_id in self._failed_saves:
                self._out.save_failed.setdefault(job.job_id, set()).add(self.rank)
            else:
                self.stats.add(C.SAVED_CHUNKS, len(chunks))
                self.stats.add(C.SAVED_BYTES, len(chunks) * self.geometry.chunk_bytes)
                self._out.saved.setdefault(job.job_id, set()).add(self.rank)
        self._saved_layers.clear()
        self._failed_saves.clear()
        self._save_plans.clear()
        # blocks held for this step's late saves are copied now: vLLM may free them
        self._releasing.update(meta.release_blocks)

    def _save_job_layer(self, job: SaveJob, layer: int) -> None:
        chunks = job.chunks.get(self.rank, [])
        if not chunks or job.job_id in self._failed_saves:
            return
        start = time.perf_counter()
        try:
            assert self.kv is not None
            plan = self._save_plans.get(job.job_id)
            if plan is None:
                plan = self._save_plans[job.job_id] = self.kv.plan(chunks)
            self.kv.save_layer(layer, self._pool(job.segments[self.rank]), plan)
        except Exception as exc:
            log.warning("kvtier save of %s failed: %r", job.req_id, exc)
            self._failed_saves.add(job.job_id)
        self.stats.add(C.SAVE_SECONDS, time.perf_counter() - start)

    # -- reporting ---------------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: set[str] | frozenset[str] = frozenset()
    ) -> tuple[set[str] | None, set[str] | None]:
        self._finish_sync_loads()
        recving, self._finished_recving = self._finished_recving, set()
        # vLLM accepts a finished send only for a request it announced as finished
        self._announced.update(finished_req_ids)
        sending = self._releasing & self._announced
        self._releasing -= sending
        self._announced -= sending
        while len(self._announced) > 65536:  # requests never held: forget the oldest
            self._announced.pop()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KvtierWorkerMetadata | None:
        out, self._out = self._out, KvtierWorkerMetadata()
        return None if out.is_empty() else out

    # -- segments ----------------------------------------------------------------------------

    def _pool(self, ref: SegmentRef) -> PoolView:
        pool = self._pools.get(ref.name)
        if pool is not None and not pool.segment.is_live():
            del self._pools[ref.name]  # the store is gone: drop the mapping
            pool.close()
            pool = None
        if pool is None:
            segment = map_segment(ref)  # RuntimeError if the store's segment is gone
            pool = PoolView(segment, pin=self.kv is not None and self.kv.is_cuda)
            self._pools[ref.name] = pool
            while len(self._pools) > MAX_MAPPED_SEGMENTS:
                _, old = self._pools.popitem(last=False)
                old.close()
        self._pools.move_to_end(ref.name)
        return pool

    def shutdown(self) -> None:
        self._finish_sync_loads()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
