"""vLLM's KV cache events on the wire, decoded without vLLM.

The index service runs without vLLM or torch, so these msgspec structs mirror vLLM's
``vllm.distributed.kv_events`` (0.32) field for field: a ZMQ multipart message
``[topic, seq (8 bytes big-endian), payload]`` whose payload is the msgpack array
``[ts, events, data_parallel_rank]``; each event is a map tagged ``{"type": "BlockStored"}``
etc., sent with ``omit_defaults``. tests/unit/index/test_vllm_blocks.py and
tests/integration/test_index_vllm_follower.py check this mirror against vLLM's own encoder and
a running engine.

Events are decoded one by one (the batch's list is kept as raw msgpack first), so one
malformed or unknown event is skipped and counted instead of losing its whole batch.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes  # 64-bit int by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)


class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block: tuple of extra hash keys, or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventBatchDecoder:
    """Decodes payloads into (timestamp, events, number of events that failed to decode).

    Not thread-safe (msgspec decoders are cheap; make one per thread).
    """

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(RawBatch)
        self._event = msgspec.msgpack.Decoder(KvEvent)

    def decode(self, payload: bytes) -> tuple[float, list[KvEvent], int]:
        """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a malformed batch."""
        batch = self._batch.decode(payload)
        events: list[KvEvent] = []
        bad = 0
        decode = self._event.decode
        for raw in batch.events:
            try:
                events.append(decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                bad += 1
        return batch.ts, events, bad


def encode_batch(ts: float, events: list[KvEvent], rank: int = 0) -> bytes:
    """The payload vLLM would publish (for tests and the ingest benchmark)."""
    return msgspec.msgpack.encode([ts, events, rank])


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # end of a replay
