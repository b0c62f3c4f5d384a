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

The common event, a ``BlockStored`` of plain tokens, is read by a small C extension
(``_ingest_c.c``, built by the install) that writes its token ids straight into the u32
little-endian bytes the block mapper hashes (``token_data``), instead of one Python int per
token: decoding was most of an index's ingest cost. Every other event, and every batch the
extension cannot read, is decoded by msgspec exactly as before; both paths give the same
events (tests/unit/index/test_vllm_wire_native.py). Without the extension (a build without a
C compiler) msgspec decodes everything, slower (``NATIVE`` says which).
"""

from __future__ import annotations

import array
import sys
from typing import Any

import msgspec

from kvtier.index.ingest.native import NATIVE
from kvtier.index.ingest.native import decode_batch as native_decode

LITTLE = sys.byteorder == "little"
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
    # not vLLM's: the tokens as u32 little-endian bytes, set by the C decoder (token_ids then
    # empty); an event arriving with it is refused (``EventBatchDecoder``)
    token_data: bytes = b""

    def tokens_u32le(self) -> bytes:
        """The token ids as u32 little-endian bytes (what chunk keys hash). Raises
        OverflowError / TypeError for ids that are not u32."""
        if self.token_data:
            return self.token_data
        packed = array.array("I", self.token_ids)
        if not LITTLE:  # pragma: no cover - big-endian hosts
            packed.byteswap()
        return packed.tobytes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_data) // 4 if self.token_data else len(self.token_ids)


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


# msgspec raises these too for malformed bytes (a str that is not UTF-8, nesting past its
# depth), not only DecodeError / ValidationError: an engine's bad event must count as bad,
# never end the thread that follows it
MSGSPEC_ALSO_RAISES = (UnicodeDecodeError, RecursionError)


class EventBatchDecoder:
    """Decodes payloads into (timestamp, events, number of events that failed to decode).

    Not thread-safe (msgspec decoders are cheap; make one per thread).
    """

    def __init__(self, native: bool = NATIVE) -> None:
        """``native=False``: msgspec decodes every event (the C decoder's reference)."""
        self._batch = msgspec.msgpack.Decoder(RawBatch)
        self._event = msgspec.msgpack.Decoder(KvEvent)
        self._native = native_decode if native else None

    def decode(self, payload: bytes) -> tuple[float, list[KvEvent], int]:
        """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a malformed batch."""
        fast = self._native(payload, BlockStored) if self._native is not None else None
        if fast is None:  # no C decoder, or a batch it leaves to msgspec (which says why)
            try:
                batch = self._batch.decode(payload)
            except MSGSPEC_ALSO_RAISES as exc:
                raise msgspec.DecodeError(f"malformed batch: {exc!r}") from exc
            ts, items = batch.ts, batch.events
        else:
            ts, items = fast
        events: list[KvEvent] = []
        bad = 0
        decode = self._event.decode
        for item in items:
            if type(item) is BlockStored:
                events.append(item)
                continue
            try:
                event = decode(item)
            except (msgspec.DecodeError, msgspec.ValidationError, *MSGSPEC_ALSO_RAISES):
                bad += 1
                continue
            if type(event) is BlockStored and event.token_data:
                bad += 1  # not a field of vLLM's: only the C decoder sets it
                continue
            events.append(event)
        return ts, events, bad


def encode_batch(ts: float, events: list[KvEvent], rank: int = 0) -> bytes:
    """The payload vLLM would publish (for tests and the ingest benchmark)."""
    return msgspec.msgpack.encode([ts, events, rank])


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # end of a replay
