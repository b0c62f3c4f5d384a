"""The worker side of the connector: moves bytes between vLLM's paged KV and the node's pool,
decides nothing.

Each step the scheduler side sends ``LoadJob``s and ``SaveJob``s (``metadata.py``) naming pool
extents and KV block ids. This class copies, verifies when asked, and reports back: loads that
finished (async) or failed (block ids vLLM must recompute), and saves whose bytes are in the
pool (the scheduler then commits them).

Failure rule: any doubt about a load's bytes (segment gone, checksum mismatch, scheduler says
the lease lapsed, an exception mid-copy) makes every block of that load a load error, reported
in the same step; vLLM recomputes them, so a failed load costs time, never a wrong token.

The copies (``PagedKV``): a chunk holds, layer after layer, the pages of its
``blocks_per_chunk`` blocks (``layout.py``); every layer's KV is viewed as ``[num_blocks,
page_bytes]`` uint8 rows, whatever the backend's page interior.
- CPU backend: memcpys (numpy) on the calling thread, one per run of consecutive block ids (a
  request's blocks mostly are). Not ``index_copy_``: on CPU it copies element by element,
  0.3 GB/s against ~10 GB/s for a slice copy (``kvtier bench kv-copy`` measures both).
- CUDA: the pool is registered with CUDA (pinned host memory) and copies run on a side stream
  ordered after the model runner's stream (``streams.py``).

Threading: called from vLLM's model-runner thread; sync loads run layer by layer on one extra
thread (``kvtier-load``) so a layer's attention can start while later layers copy (different
layers, never the same pages at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvtier.config_connector import ConnectorConfig
from kvtier.connector.counters import C, Tally
from kvtier.connector.layout import KvGeometry
from kvtier.connector.metadata import (
    ChunkCopy,
    KvtierMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    SaveJob,
    SegmentRef,
)
from kvtier.connector.streams import DeviceOrdering, HostOrdering
from kvtier.tiers.cpu import SharedSegment, checksum_views, map_segment

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
        # held blocks: requests whose late saves were copied, and requests vLLM said finished
        self._releasing: set[str] = set()
        self._announced: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv = PagedKV(kv_caches, self.geometry)
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
                self.kv.ordering.bind_compute()
            sync_jobs = [job for job in meta.loads if not job.is_async]
            for job in meta.loads:
                if job.is_async:
                    self._run_load(job, range(self.geometry.num_layers))
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
            for layer in range(self.geometry.num_layers):
                for job in jobs:
                    if job.req_id not in self._out.load_failed:
                        self._run_load(job, (layer,), final=layer == self.geometry.num_layers - 1)
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

    def _run_load(self, job: LoadJob, layers: range | tuple[int, ...], final: bool = True) -> None:
        if job.failed:
            self._fail_load(job, job.failed)
            return
        chunks = job.chunks.get(self.rank, [])
        if not chunks:
            return
        start = time.perf_counter()
        try:
            assert self.kv is not None, "register_kv_caches was not called"
            pool = self._pool(job.segments[self.rank])
            if not pool.segment.is_live():
                raise RuntimeError(f"pool segment {pool.segment.name} is no longer the store's")
            for layer in layers:
                self.kv.load_layer(layer, pool, chunks)
            if final:
                self.kv.synchronize()
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
                self.kv.synchronize()
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
        # blocks held for this step's late saves are copied now: vLLM may free them
        self._releasing.update(meta.release_blocks)

    def _save_job_layer(self, job: SaveJob, layer: int) -> None:
        chunks = job.chunks.get(self.rank, [])
        if not chunks or job.job_id in self._failed_saves:
            return
        start = time.perf_counter()
        try:
            assert self.kv is not None
            self.kv.save_layer(layer, self._pool(job.segments[self.rank]), chunks)
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


# -- the copies ---------------------------------------------------------------------------


def page_rows(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` (one layer, blocks first) as ``[num_blocks, page_bytes]`` uint8 rows.

    Each block's page must be contiguous (true of vLLM's layouts: CPU's contiguous tensors and
    CUDA's strided per-layer views alike); rows may be strided.
    """
    if not kv[0].is_contiguous():
        raise ValueError(f"a KV block page is not contiguous (shape {tuple(kv.shape)})")
    num_blocks, page_elems = kv.shape[0], kv[0].numel()
    rows = torch.as_strided(kv, (num_blocks, page_elems), (kv.stride(0), 1))
    return rows.view(torch.uint8)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first block id, count)`` for each run of consecutive ids in ``block_ids``,
    ``position`` being the run's index in ``block_ids``."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(block_ids):
        if runs:
            first_pos, first_block, count = runs[-1]
            if block == first_block + count:
                runs[-1] = (first_pos, first_block, count + 1)
                continue
        runs.append((position, block, 1))
    return runs


def _pieces(
    extents: Sequence[tuple[int, int]], start: int, length: int
) -> Iterator[tuple[int, int]]:
    """Segment (offset, length) pieces covering chunk bytes ``[start, start + length)``."""
    pos = 0
    for offset, size in extents:
        lo, hi = max(start, pos), min(start + length, pos + size)
        if lo < hi:
            yield offset + lo - pos, hi - lo
        pos += size
        if pos >= start + length:
            return


def _host_pages(
    pool: PoolView, extents: Sequence[tuple[int, int]], start: int, count: int, page_bytes: int
) -> np.ndarray:
    """Chunk bytes ``[start, start + count pages)`` as ``[count, page_bytes]``: a view of the
    pool, or a copy when they span extents (a chunk the allocator had to split).

    ``PoolView.read`` in numpy: slicing and viewing torch tensors costs a few µs per chunk and
    layer, 15 % of an 8k-token load (``kvtier bench kv-copy``), so the CPU path skips torch."""
    pieces = list(_pieces(extents, start, count * page_bytes))
    array = pool.segment.array
    if len(pieces) == 1:
        offset, n = pieces[0]
        return array[offset : offset + n].reshape(count, page_bytes)
    return np.concatenate([array[o : o + n] for o, n in pieces]).reshape(count, page_bytes)


class PoolView:
    """A pool segment as a torch uint8 tensor (registered with CUDA when asked)."""

    def __init__(self, segment: SharedSegment, pin: bool) -> None:
        self.segment = segment
        self.tensor = torch.from_numpy(segment.array)
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(
                self.tensor.data_ptr(), self.tensor.numel(), 0
            )
            self.pinned = int(rc[0] if isinstance(rc, tuple) else rc) == 0
            if not self.pinned:
                log.warning("cudaHostRegister of the pool failed (%s): copies will block", rc)

    def read(self, extents: Sequence[tuple[int, int]], start: int, length: int) -> torch.Tensor:
        """Chunk bytes ``[start, start + length)``: a view, or a copy if they span extents."""
        pieces = list(_pieces(extents, start, length))
        if len(pieces) == 1:
            offset, n = pieces[0]
            return self.tensor[offset : offset + n]
        return torch.cat([self.tensor[o : o + n] for o, n in pieces])

    def write(
        self,
        extents: Sequence[tuple[int, int]],
        start: int,
        data: torch.Tensor,
        non_blocking: bool = False,
    ) -> None:
        flat = data.reshape(-1)
        pos = 0
        for offset, n in _pieces(extents, start, flat.numel()):
            self.tensor[offset : offset + n].copy_(flat[pos : pos + n], non_blocking=non_blocking)
            pos += n

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


class PagedKV:
    def __init__(self, kv_caches: dict[str, torch.Tensor], geometry: KvGeometry) -> None:
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"KV caches lack layers {missing[:3]}")
        self.geometry = geometry
        self.rows = [page_rows(kv_caches[name]) for name in geometry.layer_names]
        for name, rows in zip(geometry.layer_names, self.rows, strict=True):
            if rows.shape[1] != geometry.page_bytes:
                raise ValueError(
                    f"layer {name}: page is {rows.shape[1]} bytes, expected {geometry.page_bytes}"
                )
        self.device = self.rows[0].device
        self.is_cuda = self.device.type == "cuda"
        self.ordering: HostOrdering | DeviceOrdering = (
            DeviceOrdering(self.device, len(self.rows)) if self.is_cuda else HostOrdering()
        )
        # CPU: numpy views of the same memory; np.copyto costs ~1 µs a call against ~10 µs
        # for torch's copy_, which matters with one call per run of blocks.
        self.host_rows = [] if self.is_cuda else [rows.numpy() for rows in self.rows]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def load_layer(self, layer: int, pool: PoolView, chunks: Sequence[ChunkCopy]) -> None:
        """Copy layer ``layer`` of ``chunks`` from the pool into the KV pages."""
        geo = self.geometry
        with self.ordering.copying():
            for chunk in chunks:
                count = len(chunk.block_ids)
                start = layer * geo.layer_bytes + chunk.first_block * geo.page_bytes
                if not self.is_cuda:
                    src_pages = _host_pages(pool, chunk.extents, start, count, geo.page_bytes)
                    rows = self.host_rows[layer]
                    for position, block, n in block_runs(chunk.block_ids):
                        np.copyto(rows[block : block + n], src_pages[position : position + n])
                    continue
                src = pool.read(chunk.extents, start, count * geo.page_bytes)
                src = src.view(count, geo.page_bytes).to(self.device, non_blocking=pool.pinned)
                self.rows[layer].index_copy_(0, self._index(chunk.block_ids), src)
            self.ordering.layer_loaded(layer)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer ``layer``'s load (CUDA); no-op on CPU."""
        self.ordering.wait_layer(layer)

    def save_layer(self, layer: int, pool: PoolView, chunks: Sequence[ChunkCopy]) -> None:
        """Copy layer ``layer`` of the KV pages of ``chunks`` into the pool."""
        geo = self.geometry
        with self.ordering.copying():
            for chunk in chunks:
                count = len(chunk.block_ids)
                start = layer * geo.layer_bytes + chunk.first_block * geo.page_bytes
                pieces = list(_pieces(chunk.extents, start, count * geo.page_bytes))
                if not self.is_cuda and len(pieces) == 1:  # gather straight into the pool
                    offset, n = pieces[0]
                    dst = pool.segment.array[offset : offset + n].reshape(count, geo.page_bytes)
                    rows = self.host_rows[layer]
                    for position, block, run in block_runs(chunk.block_ids):
                        np.copyto(dst[position : position + run], rows[block : block + run])
                    continue
                pages = torch.index_select(self.rows[layer], 0, self._index(chunk.block_ids))
                pool.write(chunk.extents, start, pages, non_blocking=self.is_cuda and pool.pinned)

    def synchronize(self) -> None:
        """Wait for every copy issued so far (CUDA); no-op on CPU."""
        self.ordering.synchronize()
