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
thread (``kvtier-load``, ``sync_loads.py``) so a layer's attention can start while later
layers copy. A load's checksums read each byte after the copy that read it has ended (so a
byte that changed under the copy also changes the sum), chunks side by side on
``verify_threads`` threads (``kvtier-verify``, ``load_sums.py``; on CUDA one thread's XXH3 is
~8x slower than a PCIe gen 5 copy).

Mapped segments (``_pools``) belong to the model-runner thread: every job's pool is mapped or
looked up there (a sync load's before its thread starts, which gets the ``PoolView``), and is
*held* until the step's copies are done (the load thread joined, saves waited for: the end of
``save``, or the next ``start_load_kv``). A segment whose store is gone (its file unlinked or
replaced: the store stopped or restarted) is unmapped at the start of each step and whenever a
new segment is mapped, but never while a job of the step holds it: then at the next of those.
Unmapping one registered with CUDA unregisters it first (``PoolView.close``). Without this
every worker kept a dead store's pool mapped, so its memory stayed allocated and the restarted
store could not reserve its own in a /dev/shm sized for one pool.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.connector.counters import C, Tally
from kvtier.connector.layout import MAMBA, KvGeometry
from kvtier.connector.load_sums import LayerwiseSums, Verifiers, bad_chunks
from kvtier.connector.metadata import (
    KvtierMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    SaveJob,
    SegmentRef,
)
from kvtier.connector.paged_kv import CopyPlan, PagedKV, PoolView
from kvtier.connector.sync_loads import SyncLoads
from kvtier.core.config.connector import ConnectorConfig
from kvtier.store.client.shm import map_segment

log = logging.getLogger(__name__)

MAX_MAPPED_SEGMENTS = 4  # live segments kept mapped (dead ones are unmapped when unheld)
RETIRE_PERIOD_S = 0.25  # how often a step looks for mapped segments whose store is gone
# (a restarted store takes longer than this to start and reserve its new pool)


class ConnectorWorker:
    def __init__(
        self, config: ConnectorConfig, geometry: KvGeometry, rank: int, saves: bool = True
    ) -> None:
        """``rank``: the data rank whose chunks this worker reads and writes
        (``ModelIdentity.data_rank``: its pipeline stage's, its TP rank's unless the KV is
        replicated); ``saves``: False on the TP ranks other than 0 of replicated KV (MLA),
        whose chunks rank 0 writes for every rank."""
        self.config = config
        self.geometry = geometry
        self.rank = rank
        self.saves_here = saves
        # hybrid models (several KV cache groups): vLLM takes load failures per request
        # (block ids are per group there), so failed loads are reported by request
        self.by_request = len(geometry.groups) > 1
        self._failed_recving: set[str] = set()
        self.kv: PagedKV | None = None
        # mapped segments by name, least recently used first (model-runner thread only);
        # held: those this step's jobs use (by id), unmapped only once the step's copies end;
        # retiring: dead or evicted ones waiting for their holders
        self._pools: OrderedDict[str, PoolView] = OrderedDict()
        self._held: dict[int, PoolView] = {}
        self._retiring: list[PoolView] = []
        self._next_retire = 0.0  # monotonic time of the next look for dead segments
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._out = KvtierWorkerMetadata()
        self.stats = Tally()
        self.sync_loads = SyncLoads(self)  # layer-wise sync loading (the kvtier-load thread)
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}
        # layer-wise saving, per step
        self._saved_layers: set[int] = set()
        self._failed_saves: set[int] = set()
        self._save_plans: dict[int, CopyPlan] = {}  # job id -> plan, for this step
        # held blocks: requests whose late saves were copied, and requests vLLM said finished
        self._releasing: set[str] = set()
        self._announced: set[str] = set()
        self._verifiers = Verifiers()  # the load checksums' threads, made when first needed

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = PagedKV(kv_caches, self.geometry, self.config.cuda_copy_kernel)
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
        try:  # the last step's copies are over (save() saw to it): nothing holds its pools
            self._end_step()
        except Exception:  # its copies cannot be waited for: its pools stay held (mapped)
            log.exception("kvtier: waiting for the last step's copies failed")
        if self._retiring or time.monotonic() >= self._next_retire:
            self._retire_dead()
        try:
            if self.kv is not None:  # this is the model runner's thread: its stream orders copies
                self.kv.bind_compute()
            sync_jobs = [job for job in meta.loads if not job.is_async]
            for job in meta.loads:
                if job.is_async:
                    self._run_load(job, None, range(self.geometry.num_layers))
                    self._finished_recving.add(job.req_id)
            if sync_jobs:
                # mapped here, not on the load thread: _pools is this thread's alone
                pools = {job.req_id: self._job_pool(job) for job in sync_jobs}
                self.sync_loads.start(sync_jobs, pools)
        except Exception as exc:  # never take the engine down: every load of the step fails
            log.exception("kvtier: starting loads failed")
            for job in meta.loads:
                if job.req_id not in self._out.load_failed:
                    self._fail_load(job, repr(exc))
                if job.is_async:
                    self._finished_recving.add(job.req_id)
            self.sync_loads.release_layers()

    def _job_pool(self, job: LoadJob) -> PoolView | None:
        """The held pool of a sync load (model-runner thread); None, the load failed, when its
        segment cannot be mapped, or when the job copies nothing."""
        if job.failed or not job.chunks.get(self.rank):
            return None
        try:
            return self._hold(job.segments[self.rank])
        except Exception as exc:
            self._fail_load(job, repr(exc))
            return None

    def _verifier_pool(self) -> ThreadPoolExecutor | None:
        return self._verifiers.pool(self.verify_threads())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.sync_loads.wait_for_layer(layer_name)

    def _finish_sync_loads(self) -> None:
        self.sync_loads.join()

    def _run_load(
        self,
        job: LoadJob,
        plan: CopyPlan | None,
        layers: range | tuple[int, ...],
        final: bool = True,
        pool: PoolView | None = None,
        sums: LayerwiseSums | None = None,
    ) -> None:
        """Copy ``layers`` of a load job through ``pool`` (a sync load's, held for it), or
        through the job's segment mapped here (async loads: the model-runner thread)."""
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
            if pool is None:
                pool = self._hold(job.segments[self.rank])
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
                    self._verify(job, pool, sums)
        except Exception as exc:
            self._fail_load(job, repr(exc))
            self._drain_loads()  # copies issued before the failure end before the pool may go
            return
        self.stats.add(C.LOAD_SECONDS, time.perf_counter() - start)
        if final:
            groups = self.geometry.groups
            self.stats.add(C.LOADED_CHUNKS, len({c.key for c in chunks}))
            self.stats.add(
                C.LOADED_BYTES,
                sum(len(c.block_ids) * len(groups[c.group].layer_names) for c in chunks)
                * self.geometry.page_bytes,
            )
            self._out.loaded.setdefault(job.req_id, set()).add(self.rank)

    def verify_threads(self) -> int:
        """Threads a load's checksums run on (``ConnectorConfig.verify_threads``)."""
        if self.config.verify_threads is not None:
            return self.config.verify_threads
        if self.kv is None or not self.kv.is_cuda:
            return 1
        return max(1, min(8, (os.cpu_count() or 2) // 2))

    def _verify(self, job: LoadJob, pool: PoolView, sums: LayerwiseSums | None = None) -> None:
        """Check every loaded chunk against its checksum (after its copies ended, so a byte
        that changed under a copy changes the sum too); report exactly the bad ones.
        ``sums``: taken layer by layer as the copies ended (CUDA sync loads)."""
        chunks = job.chunks.get(self.rank, [])
        taken = sums.bad(job.req_id) if sums is not None else None
        bad, unsummed = bad_chunks(chunks, pool.segment.array, self._verifier_pool(), taken)
        if unsummed:
            self.stats.add(C.UNVERIFIED_CHUNKS, unsummed)
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
        if self.by_request:
            self._failed_recving.add(job.req_id)
        else:
            self._load_errors.update(blocks)
        self._out.error_blocks.update(blocks)
        self.stats.add(C.LOAD_ERROR_BLOCKS, len(blocks))
        self._out.load_failed.setdefault(job.req_id, set()).add(self.rank)

    # -- saves -------------------------------------------------------------------------------

    def save_layer(self, meta: KvtierMetadata, layer_name: str) -> None:
        """Right after a layer's forward: its pages of the chunks this step completes are final,
        so copy them now (on CUDA the copy overlaps the next layers' compute)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves or not self.saves_here:
            return
        for job in meta.saves:
            self._save_job_layer(job, layer)
        self._saved_layers.add(layer)

    def save(self, meta: KvtierMetadata) -> None:
        """End of the step (wait_for_save): copy the layers ``save_layer`` did not see, wait for
        the copies, report. The scheduler commits a chunk when every rank reported it."""
        self._finish_sync_loads()
        if not self.saves_here:  # replicated KV: rank 0 saves it for every rank
            self._held.clear()
            self._releasing.update(meta.release_blocks)
            return
        try:
            for job in meta.saves:
                if not job.chunks.get(self.rank):
                    continue
                for layer in range(self.geometry.num_layers):
                    if layer not in self._saved_layers:
                        self._save_job_layer(job, layer)
            if self.kv is not None:
                self.kv.finish_saves()
            self._held.clear()  # the step's copies are done (loads joined, saves waited for)
        except Exception as exc:  # the pools stay held: the next step waits again first
            log.warning("kvtier: waiting for saves failed: %r", exc)
            self._failed_saves.update(job.job_id for job in meta.saves)
        for job in meta.saves:
            chunks = job.chunks.get(self.rank, [])
            if not chunks:
                continue
            if job.job_id in self._failed_saves:
                self._out.save_failed.setdefault(job.job_id, set()).add(self.rank)
            else:
                geo = self.geometry
                # one copy per KV cache group; a chunk without state (no copy of a Mamba
                # group) is its attention bytes alone
                whole: dict[bytes, bool] = {}
                for c in chunks:
                    whole[c.key] = whole.get(c.key, False) or geo.groups[c.group].kind == MAMBA
                n = len(whole)
                stateless = sum(not w for w in whole.values()) if geo.has_state else 0
                self.stats.add(C.SAVED_CHUNKS, n)
                self.stats.add(
                    C.SAVED_BYTES,
                    (n - stateless) * geo.chunk_bytes + stateless * geo.attention_bytes,
                )
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
            self.kv.save_layer(layer, self._hold(job.segments[self.rank]), plan)
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

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed (hybrid models: vLLM recomputes each from its start)."""
        self._finish_sync_loads()
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_meta(self) -> KvtierWorkerMetadata | None:
        out, self._out = self._out, KvtierWorkerMetadata()
        return None if out.is_empty() else out

    # -- segments ----------------------------------------------------------------------------

    def premap(self, ref: SegmentRef) -> None:
        """Map the pool of ``ref`` now (at start-up), not on the first load or save that names
        it. Model-runner thread only; a segment that cannot be mapped is left to that load."""
        try:
            self._pool(ref)
        except (RuntimeError, OSError) as exc:
            log.info("kvtier: pool %s not mapped at start-up: %s", ref.name, exc)

    def _hold(self, ref: SegmentRef) -> PoolView:
        """The mapped pool of ``ref`` for a job of this step, held (never unmapped) until the
        step's copies are done. Model-runner thread only. RuntimeError if the store's segment
        is gone."""
        pool = self._pool(ref)
        self._held[id(pool)] = pool
        return pool

    def _pool(self, ref: SegmentRef) -> PoolView:
        """The mapped pool of ``ref``, mapping it (and unmapping the segments of stores that
        are gone, unless held) if it is new. Model-runner thread only."""
        pool = self._pools.get(ref.name)
        if pool is not None and not pool.segment.is_live():
            del self._pools[ref.name]  # the store is gone (or a new one took the name)
            self._retiring.append(pool)
            pool = None
        if pool is None:
            self._retire_dead()  # a new incarnation: unmap the stores that are gone
            segment = map_segment(ref)  # RuntimeError if the store's segment is gone
            pool = PoolView(segment, pin=self.kv is not None and self.kv.is_cuda)
            excess = len(self._pools) + 1 - MAX_MAPPED_SEGMENTS
            if excess > 0:  # least recently used first, never one this step holds
                idle = [name for name, p in self._pools.items() if id(p) not in self._held]
                self._retiring.extend(self._pools.pop(name) for name in idle[:excess])
                self._unmap_retired()
            self._pools[ref.name] = pool
        self._pools.move_to_end(ref.name)
        return pool

    def _retire_dead(self) -> None:
        """Unmap every mapped segment whose store is gone (file unlinked or replaced), except
        those a job of this step holds: they go at the next step's start or mapping. Costs a
        stat per mapped segment (normally one): 3 µs warm, but ~70 µs as the first work of a
        step after a forward pass (cold caches; ``kvtier bench decode-overhead``), so a step
        runs it only every ``RETIRE_PERIOD_S`` or while a retired segment waits. This only
        frees memory: a load checks its own segment before and after copying, and a save into
        a dead store's segment is never committed (segment names carry the incarnation's
        epoch, so a new store never reuses a mapping). Never raises: a failure leaves the
        mappings for the next try."""
        self._next_retire = time.monotonic() + RETIRE_PERIOD_S
        try:
            for name, pool in list(self._pools.items()):
                if not pool.segment.is_live():
                    del self._pools[name]
                    self._retiring.append(pool)
            self._unmap_retired()
        except Exception:
            log.exception("kvtier: unmapping dead pool segments failed")

    def _unmap_retired(self) -> None:
        idle = [pool for pool in self._retiring if id(pool) not in self._held]
        if not idle:
            return
        self._retiring = [pool for pool in self._retiring if id(pool) in self._held]
        # No copy can be in flight through an unheld pool (a failed load waited for its
        # copies, saves are waited for in save()); this wait only makes sure (mid-step, it
        # waits for the step's loads issued so far: once per store restart).
        if not self._drain_loads():
            self._retiring.extend(idle)  # not provably idle: kept mapped
            return
        for pool in idle:
            name = pool.segment.name
            pool.close()  # CUDA: unregistered before the memory is unmapped
            pool.segment.close()
            if pool.segment.unmapped:
                log.info("kvtier worker rank %d: unmapped pool segment %s", self.rank, name)
            else:  # a view of it is still alive: unmapped when that goes
                log.warning("kvtier: pool segment %s is still referenced, not unmapped", name)

    def _end_step(self) -> None:
        """The step's copies are over: the load thread joined, every copy waited for (here
        when ``save`` did not run), so no job holds a mapping any more. Raises (nothing
        released) if waiting for the copies failed."""
        self._finish_sync_loads()
        if self._held and self.kv is not None:
            self.kv.finish_loads()
            self.kv.finish_saves()
        self._held.clear()

    def _drain_loads(self) -> bool:
        """Wait for every load copy issued so far (CUDA; no-op on CPU). False if that failed."""
        if self.kv is None:
            return True
        try:
            self.kv.finish_loads()
        except Exception:
            log.exception("kvtier: waiting for load copies failed")
            return False
        return True

    def shutdown(self) -> None:
        try:
            self._end_step()
        except Exception:
            log.exception("kvtier: waiting for copies at shutdown failed")
            return  # leave the mappings to the process's exit
        self._verifiers.shutdown()
        self._retiring.extend(self._pools.values())
        self._pools.clear()
        self._unmap_retired()
