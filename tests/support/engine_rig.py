"""vLLM's real ``Scheduler`` driving the kvtier connector, with a stand-in model that knows
exactly what every KV page must hold.

What is real: vLLM 0.32's ``Scheduler`` (its queues, prefix cache, preemption, chunked
prefill, failed-load handling, streaming-input sessions) creating ``KvtierConnector`` through
its own factory; kvtier's ``ConnectorWorker`` copying between a paged CPU KV cache (laid out
as vLLM allocates it, ``kvtier.bench.micro.kv_layouts``) and the store's pool; the store (embedded,
or a real process when ``store_address`` is given).

What stands in for the model: each step "computes" the KV of the tokens it schedules by
writing, in every layer, each touched page as a digest of the tokens up to that page's last
computed position. Before it computes, it checks every full block the request attends to
(those before the step's first token): a page that does not hold the digest of its tokens
is KV the real model would have read wrong: the step then writes garbage pages (as the model
would), and a token sampled over it that vLLM accepts is recorded in ``EngineRig.wrong``
(vLLM discards the step of a failed sync load: reading unloaded KV there is expected). That
is the oracle: a hit is exact iff ``wrong`` stays empty. The worker's hooks run in the model
runner's order (``start_load_kv``; per layer ``wait_for_layer_load``, compute,
``save_kv_layer``; ``wait_for_save``; ``get_finished``; load errors; worker metadata).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench.micro import kv_layouts
from kvtier.connector.metadata import KvtierMetadata
from kvtier.connector.worker import ConnectorWorker
from kvtier.testing.models import make_tiny_llama

BLOCK = 16
HEADS = 2
HEAD_SIZE = 16


@dataclass
class Wrong:
    """A token vLLM accepted that was sampled over a page not holding its tokens' KV."""

    step: int
    req_id: str
    block_index: int
    block_id: int


@dataclass
class StepReport:
    scheduled: dict[str, int]  # req id -> tokens computed this step
    starts: dict[str, int]  # req id -> tokens computed before this step (hits included)
    load_errors: set[int]
    finished: set[str]
    preempted: set[str]
    sampled: dict[str, int] = field(default_factory=dict)


def page_digest(layer: int, tokens: list[Any], page_bytes: int) -> np.ndarray:
    """What the stand-in model writes for a page holding the KV of ``tokens``' last block."""
    seed = hashlib.blake2b(repr((layer, tokens)).encode(), digest_size=64).digest()
    return np.frombuffer(seed * (page_bytes // 64), dtype=np.uint8)


class EngineRig:
    def __init__(
        self,
        tmp_path: Path,
        *,
        num_blocks: int = 64,
        chunk_tokens: int = 32,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 8,
        extra: dict[str, Any] | None = None,
        failure_policy: str = "recompute",
        async_scheduling: bool = False,
        encoder_budget: int = 0,
        prefix_caching: bool = True,
        model: Path | None = None,
    ) -> None:
        """``encoder_budget``: encoder tokens per step, as a multimodal model would have (the
        tiny text model has none; the stand-in computes images' KV like any token's)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = model or make_tiny_llama(tmp_path / "model", num_layers=2)
        layers = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
        extra_config = {
            "chunk_tokens": chunk_tokens,
            "min_hit_tokens": {"cpu": chunk_tokens},
            "store": {
                "run_dir": str(tmp_path / "run"),
                "pool": {"capacity": 16 << 20, "page_size": 64 << 10},
            },
            **(extra or {}),
        }
        max_len = 4096
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=max_len),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvtierConnector",
                kv_connector_module_path="kvtier.connector",
                kv_role="kv_both",
                kv_load_failure_policy=failure_policy,
                kv_connector_extra_config=extra_config,
            ),
            device_config=DeviceConfig("cpu"),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler_class: Any = Scheduler
        if async_scheduling:  # vLLM's default on CUDA; its CPU build turns it off in config
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            vllm_config.scheduler_config.async_scheduling = True
            scheduler_class = AsyncScheduler
        self.scheduler = scheduler_class(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
            log_stats=False,  # the connector keeps its counters for take_stats()
        )
        if encoder_budget:
            from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

            self.scheduler.max_num_encoder_input_tokens = encoder_budget
            self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_budget)
        self.connector = self.scheduler.connector
        assert self.connector is not None
        sched = self.connector.scheduler
        self.geometry = sched.geometry
        case = kv_layouts.CacheCase(
            "rig",
            "CPU",
            "LBNHC",
            (
                kv_layouts.Group(
                    kv_layouts.PageSpec(BLOCK, HEADS, 2 * HEAD_SIZE * 4, torch.float32), layers
                ),
            ),
        )
        assert case.page_bytes == self.geometry.page_bytes
        self.buffer, views = kv_layouts.allocate(case, num_blocks, "cpu")
        self.placement = kv_layouts.placements(case, num_blocks)[0]
        self.bytes = self.buffer.view(torch.uint8).numpy()
        self.worker = ConnectorWorker(self.connector.config, self.geometry, 0)
        self.worker.register_kv_caches(views)
        # vLLM takes the connector's counters each step: keep a running total for the tests
        self.counters: dict[str, float] = {}
        take = sched.take_stats

        def take_and_total() -> dict[str, float]:
            data = take()
            for name, value in data.items():
                self.counters[name] = self.counters.get(name, 0) + value
            return data

        sched.take_stats = take_and_total  # type: ignore[method-assign]
        self.steps = 0
        self.wrong: list[Wrong] = []
        self.requests: dict[str, Any] = {}  # every request added, finished ones too
        self._read_wrong: dict[str, tuple[int, int]] = {}  # this step: req -> (index, block)

    # -- requests ------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1, **kwargs: Any) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            req_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=self.scheduler.kv_cache_manager.block_hasher
            if hasattr(self.scheduler.kv_cache_manager, "block_hasher")
            else self._hasher(),
            **kwargs,
        )
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    def _hasher(self) -> Any:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        return get_request_block_hasher(BLOCK, sha256)

    def outputs_of(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # -- the oracle ----------------------------------------------------------------------------

    def _page(self, layer: int, block_id: int) -> slice:
        p = self.placement
        at = p.offset + layer * p.layer_stride + block_id * p.block_stride
        return slice(at, at + self.geometry.page_bytes)

    @staticmethod
    def kv_inputs(request: Any) -> list[Any]:
        """What a position's KV depends on: its token id, or for a position inside an image's
        placeholder the image itself (its identifier), whatever placeholder id it carries."""
        inputs: list[Any] = list(request.all_token_ids)
        for feature in request.mm_features or ():
            at = feature.mm_position.offset
            for i in range(feature.mm_position.length):
                inputs[at + i] = (feature.identifier, i)
        return inputs

    def _check_and_compute(self, layer: int, req_id: str, start: int, count: int) -> None:
        request = self.scheduler.requests[req_id]
        tokens = self.kv_inputs(request)
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        page_bytes = self.geometry.page_bytes
        bad = None
        for b in range(start // BLOCK):  # full blocks this step attends to
            want = page_digest(layer, tokens[: (b + 1) * BLOCK], page_bytes)
            if not np.array_equal(self.bytes[self._page(layer, block_ids[b])], want):
                bad = b
                self._read_wrong.setdefault(req_id, (b, block_ids[b]))
                break
        end = start + count
        for b in range(start // BLOCK, -(-end // BLOCK)):
            upto = min((b + 1) * BLOCK, end)
            # computed over wrong KV, the model writes wrong KV
            what = tokens[:upto] if bad is None else [-1, *tokens[:upto]]
            self.bytes[self._page(layer, block_ids[b])] = page_digest(layer, what, page_bytes)

    # -- one engine step -----------------------------------------------------------------------

    def step(self, corrupt: Any = None) -> StepReport:
        """Schedule, run the worker's hooks around the stand-in compute, feed the output back.
        ``corrupt(meta)`` runs after scheduling, before the worker copies (fault injection)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        self.steps += 1
        meta = out.kv_connector_metadata
        assert isinstance(meta, KvtierMetadata)
        if corrupt is not None:
            corrupt(meta)
        scheduled = dict(out.num_scheduled_tokens)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
        self._read_wrong = {}
        self.worker.start_load_kv(meta)
        for layer, name in enumerate(self.geometry.layer_names):
            self.worker.wait_for_layer_load(name)
            for req_id, count in scheduled.items():
                self._check_and_compute(layer, req_id, starts[req_id], count)
            self.worker.save_layer(meta, name)
        self.worker.save(meta)
        sending, recving = self.worker.get_finished(set(out.finished_req_ids))
        errors = self.worker.get_block_ids_with_load_errors()
        worker_meta = self.worker.take_worker_meta()
        req_ids = list(scheduled)
        sampled: dict[str, int] = {}
        tokens_out: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            if starts[req_id] + scheduled[req_id] >= request.num_tokens:
                token = 10 + sum(request.all_token_ids) % 400  # the stand-in's next token
                sampled[req_id] = token
                tokens_out.append([token])
            else:
                tokens_out.append([])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens_out,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=errors,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        before = {r: len(self.requests[r].output_token_ids) for r in sampled}
        self.scheduler.update_from_output(out, runner)
        for req_id, (index, block_id) in self._read_wrong.items():
            if req_id in sampled and len(self.requests[req_id].output_token_ids) > before[req_id]:
                self.wrong.append(Wrong(self.steps, req_id, index, block_id))
        return StepReport(
            scheduled,
            starts,
            errors,
            set(out.finished_req_ids),
            set(out.preempted_req_ids or ()),
            sampled,
        )

    def run(self, max_steps: int = 200, corrupt: Any = None) -> list[StepReport]:
        """Steps until nothing is left to schedule."""
        reports = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                break
            reports.append(self.step(corrupt))
        return reports

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until the embedded store has checksummed every committed chunk (it does so
        off the writer's path; a load with ``verify_loads`` stops before unsummed chunks)."""
        core = self.connector.scheduler.pool.store.core
        deadline = time.monotonic() + timeout
        while core.upkeep.unsummed_count() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
