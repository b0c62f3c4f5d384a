"""``KvtierConnector``: kvtier behind vLLM's ``KVConnectorBase_V1``, no vLLM patches.

vLLM creates one instance per role: SCHEDULER in the engine-core process (all control: lookups,
leases, allocation, commits; see ``scheduler.py``) and WORKER in each model-runner process
(data movement only; see ``worker.py``). This class adapts vLLM's calls to those two.

With no ``store_address`` the scheduler-side instance embeds the node store; workers map its
pool segment by name, so embedded mode works whether vLLM runs in one process or several.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.config import parse_extra_config, with_engine_constraints
from kvtier.connector.counters import C
from kvtier.connector.guard import HookGuard
from kvtier.connector.layout import KvGeometry, ModelIdentity, describe
from kvtier.connector.metadata import KvtierMetadata, KvtierWorkerMetadata
from kvtier.connector.model_support import prefix_reuse_refused
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.connector.stats import KvtierPromMetrics, KvtierStats
from kvtier.connector.worker import ConnectorWorker
from kvtier.core.chunks import SegmentRef
from kvtier.core.config import KvtierConfig
from kvtier.core.errors import KvtierError
from kvtier.tiers import PoolTier, open_tiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")

# where vLLM's own counters say a tier's tokens came from
_HIT_SOURCE = {
    "cpu": CacheHitSource.HOST,
    "remote": CacheHitSource.P2P,
    "disk": CacheHitSource.DISK,
}


P = ParamSpec("P")
R = TypeVar("R")


def _timed(
    hook: Callable[Concatenate[KvtierConnector, P], R],
) -> Callable[Concatenate[KvtierConnector, P], R]:
    """Add the wall time of ``hook`` to the instance's hook seconds: what the engine's loop
    waited for kvtier (each role's hooks run on one vLLM thread: no lock needed)."""

    @functools.wraps(hook)
    def timed(self: KvtierConnector, /, *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._hook_s += time.perf_counter() - start

    return timed


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """Implements ``SupportsHMA``: vLLM keeps a hybrid model's KV cache groups (full and
    sliding-window attention) apart, and kvtier stores per group what a hit needs
    (``layout.py``). Models kvtier cannot store are refused at start-up with the reason."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # the whole config model, kv_connector_extra_config applied as its flags
        self.settings = parse_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        asked = self.settings.connector
        geometry, identity = describe(
            vllm_config,
            kv_cache_config,
            asked.chunk_tokens,
            asked.model_id,
            weights_tag=asked.weights_tag,
            fingerprint=asked.fingerprint_weights and role == KVConnectorRole.SCHEDULER,
        )
        self.config = with_engine_constraints(
            asked,
            bool(vllm_config.scheduler_config.async_scheduling),
            hybrid=len(geometry.groups) > 1,
        )
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        self.guard = HookGuard()
        self._hook_s = 0.0  # since the last stats
        self._announcer: Any = None
        if role == KVConnectorRole.SCHEDULER:
            # lazy: an engine may start before its node store (misses until it is up)
            tiers = open_tiers(self.settings, lazy=True)
            self._announcer = self._announce(vllm_config, geometry, identity, tiers.pool)
            refused = prefix_reuse_refused(vllm_config)
            if refused:
                log.warning("kvtier: %s", refused)
            self.scheduler = ConnectorScheduler(
                self.config,
                geometry,
                identity,
                tiers,
                no_hits_reason=refused,
                step_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            )
            log.info(
                "kvtier connector (scheduler): store %s, chunks of %d tokens = %d bytes",
                self.settings.store.address or "embedded",
                self.config.chunk_tokens,
                geometry.chunk_bytes,
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
            rank = identity.data_rank(geometry, tp_rank, get_pp_group().rank_in_group)
            saves = tp_rank == 0 or not geometry.replicated
            self.worker = ConnectorWorker(self.config, geometry, rank, saves)

    # ==== scheduler side =====================================================================

    def _announce(
        self, vllm_config: VllmConfig, geometry: KvGeometry, identity: ModelIdentity, tier: PoolTier
    ) -> Any:
        """With an index and vLLM's KV events on, tell the index to follow this instance (what
        it holds in GPU memory, for routers), instead of configuring every engine there."""
        events = vllm_config.kv_events_config
        index_address = self.settings.index.address
        if (
            not index_address
            or events is None
            or not events.enable_kv_cache_events
            or events.publisher != "zmq"
        ):
            return None
        from kvtier.core import engine_hint
        from kvtier.core.rpc import ClientAuth
        from kvtier.index.api import LocationKind, Registration
        from kvtier.index.client.announce import Announcer

        def reachable(endpoint: str) -> str:
            host = self.config.instance_host
            return endpoint.replace("*", host).replace("0.0.0.0", host)

        endpoints = {
            "events": reachable(events.endpoint),
            "topic": events.topic,
            engine_hint.READER_ENDPOINT: engine_hint.READER,  # it reads the router's word
        }
        if self.config.instance_api:  # routers find the instance through the index
            endpoints["api"] = self.config.instance_api
        if events.replay_endpoint:
            endpoints["replay"] = reachable(events.replay_endpoint)
        namespaces = tuple(identity.namespace(geometry, r) for r in identity.data_ranks(geometry))
        name = self.config.instance_id or f"vllm-{self._kv_transfer_config.engine_id}"
        try:
            node = tier.info.node_id
        except KvtierError:  # store not up: the index learns the node from the store later
            node = ""
        registration = Registration(
            name,
            LocationKind.INSTANCE,
            tuple(ns.root_key() for ns in namespaces),
            node=node,
            endpoints=endpoints,
        )
        auth = ClientAuth.from_config(self.settings.auth)
        return Announcer(index_address, registration, namespaces, auth=auth)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.bind_blocks(
            kv_cache_manager.get_block_ids,
            kv_cache_manager.block_pool.null_block.block_id,
            kv_cache_manager.evict_blocks,
        )

    @_timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:  # this request is a miss; the engine keeps serving
            self._contained("get_num_new_matched_tokens", exc)
            return 0, False
        finally:  # an idle engine's wait for a lookup held no step up: not hook time
            self._hook_s -= self.scheduler.lookups.idle_wait_s
            self.scheduler.lookups.idle_wait_s = 0.0

    @_timed
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        try:
            self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)
        except Exception as exc:
            self._contained("update_state_after_alloc", exc)
            if num_external_tokens:  # vLLM counts them as loaded: make them load errors
                self.scheduler.fail_external(
                    request.request_id,
                    block_ids,
                    self.scheduler.local_hit(request.request_id),
                    num_external_tokens,
                )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self.scheduler is not None
        sources = self.scheduler.hit_sources.get(request.request_id)
        if not sources or sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return {_HIT_SOURCE[tier]: n for tier, n in sources.items() if n}

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        try:
            scheduled = [
                (r.req_id, r.num_computed_tokens, scheduler_output.num_scheduled_tokens[r.req_id])
                for r in scheduler_output.scheduled_new_reqs
            ]
            cached = scheduler_output.scheduled_cached_reqs
            scheduled += [
                (
                    req_id,
                    cached.num_computed_tokens[i],
                    scheduler_output.num_scheduled_tokens[req_id],
                )
                for i, req_id in enumerate(cached.req_ids)
            ]
            preempted = set(scheduler_output.preempted_req_ids or ())
        except Exception as exc:
            self._contained("build_connector_meta", exc)
            scheduled, preempted = [], set()
        # never raises: loads go out whatever happens (failed ones as failures)
        return self.scheduler.build_meta(scheduled, preempted)

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        try:
            meta = connector_output.kv_connector_worker_meta
            self.scheduler.on_worker_output(
                meta if isinstance(meta, KvtierWorkerMetadata) else None
            )
        except Exception as exc:
            self._contained("update_connector_output", exc)

    @_timed
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        try:
            # True only while a save of its blocks waits for pool space (then the workers
            # report it finished sending once copied); saves otherwise copy within the step
            # that completes a chunk, so the blocks are free to go.
            return self.scheduler.request_finished(request.request_id), None
        except Exception as exc:
            self._contained("request_finished", exc)
            return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's ``request_finished``: the decision does not depend on the
        block ids (a save waiting for pool space holds every group's blocks)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache: clear an embedded store; with a shared node store,
        bump this instance's namespace (``on_reset: bump``): it never reads a chunk stored
        before the reset, and other instances keep theirs."""
        assert self.scheduler is not None
        try:
            if self.scheduler.tiers.embedded:
                self.scheduler.pool.clear()
                return True
            if self.config.on_reset == "refuse":
                log.warning("kvtier: not resetting a shared node store (on_reset: refuse)")
                return False
            generation = self.scheduler.bump_namespace()
            log.warning(
                "kvtier: reset_prefix_cache with a shared store: namespace bumped to generation "
                "%d (chunks stored before are no longer read by this instance; instances that "
                "must keep sharing after in-place weight updates should set weights_tag)",
                generation,
            )
            return True
        except Exception as exc:
            self._contained("reset_cache", exc)
            return False

    def _contained(self, hook: str, exc: Exception) -> None:
        self.guard.record(hook, exc)
        if self.scheduler is not None:
            self.scheduler.tally.add(C.HOOK_ERRORS)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Sync loads wait per layer (``wait_for_layer_load``), which a full CUDA graph would
        skip on replay: the attention of a request with one token left in a uniform-decode
        batch would read pages still being copied. Saves are safe either way (layers a graph
        skipped are copied in ``wait_for_save``)."""
        load_mode = (extra_config or {}).get("load_mode")
        if load_mode is None:
            from kvtier.core.config import load_config

            load_mode = load_config().connector.load_mode
        return load_mode == "sync"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)
        segment = node_pool_segment(self.settings)
        if segment is not None:
            # now, at start-up: mapping (and populating) the pool on the first load cost that
            # load ~0.1 s per GiB of pool (an instance's first DRAM hit: `make run`'s demo)
            self.worker.premap(segment)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        self.worker.start_load_kv(meta)  # contains its own failures (they become load errors)

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        try:
            self.worker.wait_for_layer_load(layer_name)
        except Exception as exc:  # the load thread reports the load itself as failed
            self.guard.record("wait_for_layer_load", exc)

    @_timed
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        try:
            self.worker.save_layer(meta, layer_name)
        except Exception as exc:  # the save is retried at wait_for_save, or reported failed
            self.guard.record("save_kv_layer", exc)

    @_timed
    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        self.worker.save(meta)

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        assert self.worker is not None
        results.failed_recving = self.worker.take_failed_recving()
        return results

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    @_timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        return self.worker.take_worker_meta()

    # ==== both ===============================================================================

    def get_kv_connector_stats(self) -> KvtierStats | None:
        data = (
            self.scheduler.take_stats()
            if self.scheduler is not None
            else self.worker.stats.take()
            if self.worker is not None
            else {}
        )
        if self._hook_s:  # a few bytes more in stats vLLM sends every step anyway
            clock = (
                C.SCHEDULER_HOOK_SECONDS if self.scheduler is not None else C.WORKER_HOOK_SECONDS
            )
            data[clock.name] = data.get(clock.name, 0.0) + self._hook_s
            self._hook_s = 0.0
        return KvtierStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats | None:
        return KvtierStats(data=dict(data)) if data is not None else KvtierStats(data={})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._announcer is not None:
            self._announcer.stop()
        if self.scheduler is not None:
            self.scheduler.shutdown()
            self.scheduler.tiers.close()
        if self.worker is not None:
            self.worker.shutdown()


def node_pool_segment(settings: KvtierConfig) -> SegmentRef | None:
    """The node store's pool segment, asked of the store once (None: embedded, or the store
    is not up yet: the pool is then mapped on the first load that names it)."""
    if not settings.store.address:
        return None
    from kvtier.core.rpc import ClientAuth
    from kvtier.store.client.grpc import GrpcStoreClient

    try:
        client = GrpcStoreClient(
            settings.store.address,
            timeout_s=settings.connector.store_timeout_s,
            lazy=True,
            auth=ClientAuth.from_config(settings.auth),
            fast_control=False,
        )
        try:
            info = client.info()
        finally:
            client.close()
    except KvtierError as exc:
        log.info("kvtier: the pool is mapped on the first load (store not reachable: %s)", exc)
        return None
    return SegmentRef(info.segment_name, info.segment_size, info.epoch)
