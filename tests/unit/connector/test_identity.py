"""What makes a namespace: fingerprints of weights, configs and adapters; refused layouts;
copy-stream ordering; bounded namespace memory; hook containment."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from kvtier.connector.fingerprint import (
    AdapterFingerprints,
    config_fingerprint,
    files_fingerprint,
    weights_fingerprint,
)
from kvtier.connector.guard import HookGuard
from kvtier.core.config import StoreConfig
from kvtier.core.keys import Namespace
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


def test_weights_fingerprint_sees_a_partial_fine_tune(tmp_path: Path) -> None:
    """4 of 50 tensors changed (8 % of the weights; a merged LoRA, a re-quantized projection)
    change it: every byte of every weight file is read."""
    import json
    import struct

    import numpy as np

    n, size = 50, 2 << 20  # 100 MB: what sampling 8 windows per file missed
    header = json.dumps(
        {
            f"layers.{i}.w": {
                "dtype": "U8",
                "shape": [size],
                "data_offsets": [i * size, (i + 1) * size],
            }
            for i in range(n)
        }
    ).encode()
    body = np.random.default_rng(0).integers(0, 255, n * size, dtype=np.uint8)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')

    def write(values: np.ndarray) -> str:
        data = struct.pack("<Q", len(header)) + header + values.tobytes()
        (model / "model.safetensors").write_bytes(data)
        return files_fingerprint(model)

    before = write(body)
    tuned = body.copy()
    for i in (3, 17, 29, 41):
        tuned[i * size : (i + 1) * size] ^= 0x5A
    assert write(tuned) != before
    assert write(body) == before


def test_file_digests_are_kept_by_path_size_mtime_and_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unchanged file is read once, also across processes (the on-disk cache); a file
    rewritten in place is read again."""
    from kvtier.connector import fingerprint

    reads: list[Path] = []
    real = fingerprint.hash_file
    monkeypatch.setattr(fingerprint, "hash_file", lambda path: reads.append(path) or real(path))
    weights = tmp_path / "model.safetensors"
    _safetensors(weights, b"\x01" * 4096)
    digests = fingerprint.FileDigests(tmp_path / "cache")
    first = digests.of(weights)
    assert digests.of(weights) == first and len(reads) == 1
    assert fingerprint.FileDigests(tmp_path / "cache").of(weights) == first  # a restart
    assert len(reads) == 1
    _safetensors(weights, b"\x02" * 4096)  # same size, other values
    assert fingerprint.FileDigests(tmp_path / "cache").of(weights) != first
    assert len(reads) == 2


def test_lora_namespace_follows_the_adapter_weights_not_its_name(
    tmp_path: Path, store_config: StoreConfig
) -> None:
    """Two adapters served under one name are two namespaces; one adapter's weights under two
    names (or paths) are one; an adapter rewritten under its name is a new namespace."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from kvtier.connector.layout import KvGeometry, ModelIdentity
    from kvtier.connector.lookup import TierResolver
    from kvtier.connector.request_state import RequestState
    from kvtier.core.config.connector import ConnectorConfig
    from kvtier.tiers import Tiers

    adapters = {}
    for name, seed in (("a", 1), ("b", 2), ("a-copy", 1)):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text('{"r": 8}')
        _safetensors(path / "adapter_model.safetensors", bytes([seed]) * 4096)
        adapters[name] = path
    geometry = KvGeometry(("l0",), 32, 1024, 64, "t")
    identity = ModelIdentity("m", "", "float32", 1, 1, tp_size=1, pp_size=1)
    tier = connect(store_config)
    resolver = TierResolver(
        ConnectorConfig(chunk_tokens=64), geometry, lambda: identity, Tiers(tier), lambda c, v: None
    )

    def namespace(lora_name: str, path: Path) -> bytes:
        lora = LoRARequest(lora_name, 1, str(path))
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), None, lora_request=lora)
        return resolver.namespaces(RequestState.of(request, 0))[0]

    try:
        tuned = namespace("tuned", adapters["a"])
        assert namespace("tuned", adapters["b"]) != tuned  # same name, other weights
        assert namespace("other-name", adapters["a-copy"]) == tuned  # same weights
        _safetensors(adapters["a"] / "adapter_model.safetensors", bytes([3]) * 4096)
        assert namespace("tuned", adapters["a"]) != tuned  # rewritten under its name
    finally:
        tier.close()


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

    from kvtier.connector.model_support import UnsupportedModel, check_parallelism

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


def _tiny_engine(tmp_path: Path, kv_block_size: int) -> tuple:
    """A VllmConfig of the tiny model (cache_config.block_size 32) and a one-layer KV cache
    config whose blocks are ``kv_block_size`` tokens (what vLLM allocated)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtier.testing.models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32"),
        cache_config=CacheConfig(block_size=32),
    )
    spec = FullAttentionSpec(
        block_size=kv_block_size, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    kv = KVCacheConfig(1, [], [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    return config, kv


def test_namespace_names_vllm_version_attention_backend_and_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Page interiors and numerics differ between vLLM versions, attention backends, GPU
    architectures and CPU kernel families: each is part of the namespace, and CPUs whose
    kernel family vLLM cannot name do not all share one name."""
    from kvtier.connector import layout

    config, kv = _tiny_engine(tmp_path, kv_block_size=32)

    def namespace() -> bytes:
        geometry, identity = layout.describe(config, kv, 64, fingerprint=False)
        assert "vllm=" in geometry.kv_layout and ";attn=" in geometry.kv_layout
        return identity.namespace(geometry, 0).root_key()

    base = namespace()
    monkeypatch.setattr(layout, "_vllm_version", lambda: "0.33.0")
    assert namespace() != base
    monkeypatch.undo()
    monkeypatch.setattr(layout, "_attention_backend", lambda c: "FLEX_ATTENTION")
    assert namespace() != base
    monkeypatch.undo()
    monkeypatch.setattr(layout, "_device_arch", lambda p: "sm90")
    assert namespace() != base
    monkeypatch.undo()
    assert namespace() == base

    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    def unknown(*args: object) -> str:
        raise RuntimeError("no kernel family")

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", unknown)
    unknown_here = namespace()
    monkeypatch.setattr(layout, "_cpu_identity", lambda: "0123456789abcdef")
    assert len({base, unknown_here, namespace()}) == 3


def test_chunks_are_whole_blocks_of_the_cache_vllm_allocated(tmp_path: Path) -> None:
    """vLLM may allocate blocks other than cache_config.block_size (MLA kernels, hybrid
    models): chunks follow the KV cache spec's block size, rounded up to whole blocks."""
    from kvtier.connector.layout import describe

    config, kv = _tiny_engine(tmp_path, kv_block_size=96)
    assert describe(config, kv, 64, fingerprint=False)[0].chunk_tokens == 96
    assert describe(config, kv, 192, fingerprint=False)[0].chunk_tokens == 192
