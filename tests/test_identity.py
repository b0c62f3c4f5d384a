"""What makes a namespace: fingerprints of weights, configs and adapters; refused layouts;
copy-stream ordering; bounded namespace memory; hook containment."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from kvtier.config import StoreConfig
from kvtier.connector.fingerprint import (
    AdapterFingerprints,
    config_fingerprint,
    files_fingerprint,
    weights_fingerprint,
)
from kvtier.connector.guard import HookGuard
from kvtier.keys import Namespace
from kvtier.tiers import connect


def _safetensors(path: Path, payload: bytes) -> None:
    import json
    import struct

    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def test_weights_fingerprint_sees_new_values_of_the_same_shape(tmp_path: Path) -> None:
    """A fine-tune saved over the same files (same names, sizes, headers) changes it; copying
    the directory elsewhere does not."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    payload = bytearray(range(256)) * 40_000  # ~10 MB: sampled, not read whole
    _safetensors(model / "model.safetensors", bytes(payload))
    before = files_fingerprint(model)
    shutil.copytree(model, tmp_path / "copy")
    assert files_fingerprint(tmp_path / "copy") == before
    payload = bytearray(b ^ 0x01 for b in payload)  # every value changes, nothing else
    _safetensors(model / "model.safetensors", bytes(payload))
    assert files_fingerprint(model) != before
    (model / "config.json").write_text('{"model_type": "llama", "rope_theta": 1}')
    assert len({before, files_fingerprint(model)}) == 2


def test_weights_fingerprint_of_unreadable_model_is_empty_and_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert weights_fingerprint("no-such-org/no-such-model") == ""
    assert "weights_tag" in caplog.text


def test_adapter_fingerprint_follows_the_weights_not_the_name(tmp_path: Path) -> None:
    adapters = AdapterFingerprints()
    a, b = tmp_path / "a", tmp_path / "b"
    for path, seed in ((a, 1), (b, 2)):
        path.mkdir()
        (path / "adapter_config.json").write_text('{"r": 8}')
        _safetensors(path / "adapter_model.safetensors", bytes([seed]) * 4096)
    fa, fb = adapters.of(str(a)), adapters.of(str(b))
    assert fa != fb
    shutil.rmtree(a)
    shutil.copytree(b, a)  # the same name (path) now holds b's weights
    assert adapters.of(str(a)) == fb
    with pytest.raises(FileNotFoundError):
        adapters.of(str(tmp_path / "missing"))


def test_config_fingerprint_sees_overrides_and_quantization() -> None:
    base = {"hf_config": {"model_type": "llama", "rope_parameters": {"rope_theta": 1e4}}}
    variants = [
        base,
        {"hf_config": {"model_type": "llama", "rope_parameters": {"rope_theta": 5e5}}},
        {**base, "quantization": "fp8"},
        {**base, "compute_dtype": "bfloat16"},
    ]
    assert len({config_fingerprint(v) for v in variants}) == len(variants)
    reordered = {"hf_config": {"rope_parameters": {"rope_theta": 1e4}, "model_type": "llama"}}
    assert config_fingerprint(reordered) == config_fingerprint(base)


def test_context_parallel_layouts_are_refused_at_startup() -> None:
    from vllm.config import ParallelConfig

    from kvtier.connector.layout import UnsupportedModel, check_parallelism

    check_parallelism(ParallelConfig())
    for fields in ({"decode_context_parallel_size": 2}, {"prefill_context_parallel_size": 2}):
        config = ParallelConfig()
        for name, value in fields.items():
            object.__setattr__(config, name, value)
        with pytest.raises(UnsupportedModel, match="context parallelism"):
            check_parallelism(config)


def test_sync_loads_require_piecewise_cuda_graphs() -> None:
    from kvtier.connector.vllm_connector import KvtierConnector

    assert KvtierConnector.requires_piecewise_for_cudagraph({"load_mode": "sync"})
    assert KvtierConnector.requires_piecewise_for_cudagraph({})  # sync is the default
    assert not KvtierConnector.requires_piecewise_for_cudagraph({"load_mode": "async"})


def test_tier_remembers_a_bounded_number_of_namespaces(store_config: StoreConfig) -> None:
    with connect(store_config, max_namespaces=4) as tier:
        ids = []
        for i in range(10):
            ns = Namespace(
                model="m", dtype="f", num_layers=1, num_kv_heads=1, head_size=1, tag=str(i)
            )
            ids.append(tier.namespace_id(ns, 4096))
        assert len(tier._namespaces) == 4
        assert list(tier._namespaces) == ids[-4:]


def test_hook_errors_are_logged_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    guard = HookGuard()
    with caplog.at_level(logging.ERROR, logger="kvtier.connector"):
        for _ in range(5):
            guard.record("get_num_new_matched_tokens", ValueError("bad salt"))
        guard.record("get_num_new_matched_tokens", KeyError("x"))
    assert guard.errors == 6
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2
