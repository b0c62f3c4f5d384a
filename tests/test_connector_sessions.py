"""A streaming-input session whose inputs change after it started: the scheduler-side connector
follows them (vLLM's own ``Request`` and its own session update; an embedded store).

vLLM's CPU build serves no multimodal model small enough for a test, so the session update is
applied with vLLM's ``Scheduler._update_request_as_session`` to a real ``Request``, exactly
as the engine does between two inputs of a session.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.config import StoreConfig
from kvtier.config_connector import ConnectorConfig
from kvtier.connector.layout import KvGeometry, ModelIdentity
from kvtier.connector.metadata import KvtierWorkerMetadata
from kvtier.connector.scheduler import ConnectorScheduler
from kvtier.tiers import Tiers, connect

CHUNK = 64
GEOMETRY = KvGeometry(
    ("layer0",), block_size=32, page_bytes=1024, chunk_tokens=CHUNK, kv_layout="t"
)
IDENTITY = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_rank=0, pp_size=1)


def _scheduler(store_config: StoreConfig) -> ConnectorScheduler:
    # verify_loads off: a lookup right after a commit would otherwise stop at chunks the
    # store has not checksummed yet (milliseconds later); these tests are about keys
    config = ConnectorConfig(chunk_tokens=CHUNK, min_hit_tokens={"cpu": CHUNK}, verify_loads=False)
    scheduler = ConnectorScheduler(config, GEOMETRY, IDENTITY, Tiers(connect(store_config)))
    scheduler.block_ids_of = lambda req_id: list(range(64))
    return scheduler


def _step(scheduler: ConnectorScheduler, request, computed: int, count: int) -> int:
    """One engine step over ``count`` tokens: the saves it plans, reported as copied."""
    meta = scheduler.build_meta([(request.request_id, computed, count)])
    scheduler.on_worker_output(KvtierWorkerMetadata(saved={job.job_id: {0} for job in meta.saves}))
    request.num_computed_tokens = computed + count
    return sum(len(job.chunks[0]) for job in meta.saves)


def _session_update(request, prompt: list[int], with_image: bool) -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import StreamingUpdate

    features = (
        [MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(offset=0, length=64))]
        if with_image
        else None
    )
    update = StreamingUpdate(features, prompt, 1, 0.0, None)
    engine = SimpleNamespace(hash_block_size=32, num_waiting_for_streaming_input=0, log_stats=False)
    Scheduler._update_request_as_session(engine, request, update)


def _request(prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("session-1", prompt, SamplingParams(max_tokens=1), None, resumable=True)


def test_image_added_later_stops_lookups_and_saves(store_config: StoreConfig) -> None:
    scheduler = _scheduler(store_config)
    try:
        request = _request(list(range(4, 204)))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        scheduler.update_state_after_alloc(request, [], 0)
        assert _step(scheduler, request, 0, 200) == 3  # chunks of text tokens: cacheable
        request.append_output_token_ids(7)
        # the session's next input brings an image: its placeholder ids do not say its KV
        _session_update(request, [9] * 64 + list(range(300, 400)), with_image=True)
        assert scheduler.get_num_new_matched_tokens(request, 192) == (0, False)
        assert _step(scheduler, request, 200, request.num_tokens - 200) == 0
    finally:
        scheduler.shutdown()
        scheduler.tiers.close()


def test_text_session_saves_only_computed_tokens_and_keys_follow_them(
    store_config: StoreConfig,
) -> None:
    """Continuing a text session drops the last sampled token (never computed) and appends
    the new input: the chunk that held it is keyed by the tokens that replaced it."""
    scheduler = _scheduler(store_config)
    try:
        request = _request(list(range(4, 131)))  # 127 tokens
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, [], 0)
        assert _step(scheduler, request, 0, 127) == 1
        request.append_output_token_ids(5)  # sampled, not computed: token 127
        _session_update(request, list(range(200, 300)), with_image=False)
        assert request.all_token_ids[127] == 200  # the sampled token is gone
        scheduler.get_num_new_matched_tokens(request, request.num_computed_tokens)
        assert _step(scheduler, request, 127, request.num_tokens - 127) == 2
        # what the store holds is what a fresh request with these tokens finds
        fresh = _request(list(request.all_token_ids))
        fresh.request_id = "fresh"
        tokens, _ = scheduler.get_num_new_matched_tokens(fresh, 0)
        assert tokens == 3 * CHUNK
    finally:
        scheduler.shutdown()
        scheduler.tiers.close()
