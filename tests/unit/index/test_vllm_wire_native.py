"""The C decoder of vLLM's KV event batches (index/ingest/_ingest_c.c) against msgspec:
every payload decodes to the same events, counts the same failures, or raises as msgspec
raises; malformed and hostile bytes never crash it."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch

from kvtier.index.ingest import vllm_wire
from kvtier.index.ingest.vllm_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatchDecoder,
    encode_batch,
)

NATIVE = EventBatchDecoder(native=True)
MSGSPEC = EventBatchDecoder(native=False)


def _plain(event: object) -> tuple:
    """An event's fields with the tokens as their u32 bytes, whichever decoder made it."""
    fields = msgspec.structs.asdict(event)  # type: ignore[call-overload]
    if isinstance(event, BlockStored):
        try:
            tokens: object = event.tokens_u32le()
        except (OverflowError, TypeError):
            tokens = ("not u32", tuple(event.token_ids))
        fields.update(token_ids=tokens, token_data=None)
    return type(event).__name__, sorted(fields.items(), key=lambda kv: kv[0])


def decode_both(payload: bytes) -> tuple:
    """Both decoders' answers, which must be equal: (ts, events, bad) or the error's type."""
    answers = []
    for decoder in (NATIVE, MSGSPEC):
        try:
            ts, events, bad = decoder.decode(payload)
            answers.append((ts, [_plain(e) for e in events], bad))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            answers.append(type(exc).__name__)
    assert answers[0] == answers[1]
    return answers[0]


def test_this_install_built_the_c_decoder() -> None:
    # the install compiles it (setup.py); a machine without a C compiler falls back to
    # msgspec, which this repository's install never does
    assert vllm_wire.NATIVE, "index/ingest/_ingest_c.c was not built: run scripts/install.sh"


def test_the_c_decoder_reads_a_plain_block_stored_itself() -> None:
    event = BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[5, 70_000, 2**32 - 1, 0],
        block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
        kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    _, (got,), bad = NATIVE.decode(encode_batch(1.5, [event]))
    assert bad == 0 and got.token_ids == [] and got.num_tokens == 4  # the C path ran
    assert got.token_data == event.tokens_u32le()
    decode_both(encode_batch(1.5, [event]))


def test_vllm_own_encoding_decodes_alike() -> None:
    """Batches as vLLM's publisher encodes them (its structs, its msgspec encoder)."""
    rng = random.Random(0)
    events = [
        VllmStored(
            block_hashes=[rng.randrange(1 << 63) for _ in range(4)],
            parent_block_hash=None if i == 0 else rng.randrange(1 << 63),
            token_ids=[rng.randrange(150_000) for _ in range(64)],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        for i in range(3)
    ]
    events += [VllmRemoved(block_hashes=[1, 2], medium="GPU"), VllmCleared()]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=12.5, events=events))
    ts, decoded, bad = decode_both(payload)
    assert ts == 12.5 and bad == 0 and len(decoded) == 5


hashes = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(min_size=0, max_size=40)
)
tokens = st.lists(
    st.one_of(
        st.integers(min_value=0, max_value=2**32 - 1),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),  # not u32: the mapper refuses
    ),
    max_size=40,
)
maybe_str = st.one_of(st.none(), st.text(max_size=8))
maybe_int = st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1))
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=6),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=tokens,
    block_size=st.integers(min_value=-4, max_value=2**40),
    lora_id=maybe_int,
    medium=maybe_str,
    lora_name=maybe_str,
    extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=4))))),
    group_idx=maybe_int,
    kv_cache_spec_kind=maybe_str,
    kv_cache_spec_sliding_window=maybe_int,
    locality=maybe_str,
    ownership=maybe_str,
    session_id=maybe_str,
)
any_event = st.one_of(
    stored_events,
    st.builds(BlockRemoved, block_hashes=st.lists(hashes, max_size=6), medium=maybe_str),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(any_event, max_size=5),
    ts=st.one_of(st.floats(allow_nan=False), st.integers(min_value=0, max_value=2**40)),
    rank=st.one_of(st.none(), st.integers(min_value=0, max_value=8)),
)
def test_any_batch_of_events_decodes_alike(events, ts, rank) -> None:
    _, decoded, bad = decode_both(msgspec.msgpack.encode([ts, events, rank]))
    assert len(decoded) + bad == len(events)


wire_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack carries


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(
        st.sampled_from(
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "token_data",
                "other",
            ]
        ),
        st.one_of(
            st.none(),
            wire_ints,
            st.text(max_size=12),
            st.binary(max_size=8),
            st.lists(wire_ints, max_size=4),
            st.just("BlockStored"),
            st.floats(),
        ),
    )
)
def test_odd_maps_decode_alike(fields) -> None:
    """Maps with missing, mistyped, unknown or foreign fields (``token_data`` is refused)."""
    decode_both(msgspec.msgpack.encode([1.0, [fields], None]))


def _valid_payload() -> bytes:
    rng = random.Random(1)
    events: list = [
        BlockStored(
            block_hashes=[rng.randrange(1 << 62) for _ in range(3)],
            parent_block_hash=7,
            token_ids=[rng.randrange(1 << 20) for _ in range(48)],
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU"),
    ]
    return encode_batch(3.25, events)


def test_every_truncation_and_byte_flip_decodes_alike_or_fails_alike() -> None:
    payload = _valid_payload()
    for cut in range(len(payload)):
        decode_both(payload[:cut])
    rng = random.Random(2)
    for _ in range(3000):
        mutated = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        decode_both(bytes(mutated))
    decode_both(payload + b"\x00")  # trailing bytes


@pytest.mark.parametrize("depth", [10, 100, 100_000])
def test_deep_nesting_never_overflows_the_stack(depth: int) -> None:
    nested = b"\x91" * depth + b"\xc0"  # [[[...nil...]]] as the batch's one event
    decode_both(b"\x93\xcb\x3f\xf0" + b"\x00" * 6 + b"\x91" + nested + b"\xc0")


def test_lengths_larger_than_the_payload_are_refused_without_allocating() -> None:
    head = b"\x93\xcb\x3f\xf0" + b"\x00" * 6
    decode_both(head + b"\xdd\xff\xff\xff\xff")  # 4 G events announced, none present
    event = b"\x84\xa4type\xabBlockStored\xacblock_hashes\xdd\xff\xff\xff\xff"
    decode_both(head + b"\x91" + event)
    tokens = b"\x81\xa9token_ids\xdd\xff\xff\xff\xff"
    decode_both(head + b"\x91" + tokens + b"\xc0")


@pytest.mark.parametrize("native", [True, False])
def test_a_str_that_is_not_utf8_costs_its_event_not_the_batch(native: bool) -> None:
    good = BlockRemoved(block_hashes=[3], medium="GPU")
    raw = msgspec.msgpack.encode(BlockRemoved(block_hashes=[4], medium="GPX"))
    bad = raw.replace(b"GPX", b"G\xe4X")  # msgspec raised UnicodeDecodeError here
    payload = b"\x93\xcb\x3f\xf0" + b"\x00" * 6 + b"\x92" + msgspec.msgpack.encode(good) + bad
    _, events, failed = EventBatchDecoder(native=native).decode(payload + b"\xc0")
    assert events == [good] and failed == 1


@pytest.mark.parametrize("native", [True, False])
def test_nesting_past_msgspec_depth_is_a_decode_error(native: bool) -> None:
    payload = b"\x93\xcb\x3f\xf0" + b"\x00" * 6 + b"\x91" + b"\x91" * 100_000 + b"\xc0\xc0"
    with pytest.raises(msgspec.DecodeError):  # msgspec raised RecursionError here
        EventBatchDecoder(native=native).decode(payload)


def test_the_c_records_of_a_stored_chunk_are_the_python_ones(monkeypatch) -> None:
    """``BlockMapper._new_chunk``'s records built in C (``native.new_records``) and in Python:
    the same ops, holdings, counts and records, over a stream of prefill steps that fork."""
    from kvtier.bench.micro.index import NS, vllm_stream
    from kvtier.index.ingest import vllm_blocks
    from kvtier.index.ingest.native import new_records

    assert new_records is not None
    payloads, _ = vllm_stream(24, seed=5)

    def mapped(native: bool) -> tuple:
        monkeypatch.setattr(vllm_blocks, "new_records", new_records if native else None)
        mapper, decoder, ops = vllm_blocks.BlockMapper([NS]), EventBatchDecoder(), []
        for payload in payloads:
            mapper.feed(decoder.decode(payload)[1])
            ops += mapper.take_ops()
        records = {h: (*r[:3], *r[4:]) for h, r in mapper._blocks.items()}  # not the window
        return ops, mapper.holdings(), dict(mapper.counts), records

    native, python = mapped(True), mapped(False)
    assert native[0] and native == python


def test_new_records_refuses_mismatched_lists() -> None:
    from kvtier.index.ingest.native import new_records

    assert new_records is not None
    with pytest.raises(ValueError):
        new_records({}, [1, 2], [None], 0, 16, None, b"", 1)
    with pytest.raises(TypeError):
        new_records({}, (1,), [None], 0, 16, None, b"", 1)
