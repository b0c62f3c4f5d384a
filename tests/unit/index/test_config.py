"""The ``[index]`` section of the one config model: file, environment, flags, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.core.config import load_config

TOML = """
[index]
backend = "redis"
redis_url = "redis://10.0.0.9:6379/2"
heartbeat_timeout_s = 12

[[index.vllm]]
instance = "vllm-a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
node = "node-5"
[[index.vllm.namespaces]]
model = "Qwen/Qwen3-8B"
dtype = "bfloat16"
num_layers = 36
num_kv_heads = 8
head_size = 128

[[index.stores]]
address = "10.0.0.5:50551"
"""


def test_index_section_from_file_env_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(TOML)
    monkeypatch.setenv("KVTIER_INDEX__GRPC_PORT", "7000")
    config = load_config(path, **{"index.http_port": 7001}).index
    assert config.backend == "redis" and config.redis_url.endswith("/2")
    assert config.grpc_port == 7000 and config.http_port == 7001
    (source,) = config.vllm
    assert source.node == "node-5" and source.namespaces[0].chunk_tokens == 256
    assert config.stores[0].address == "10.0.0.5:50551"
    assert config.heartbeat_timeout_s == 12


def test_index_defaults_are_embedded_and_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    config = load_config().index
    assert config.address is None and config.backend == "memory" and not config.vllm


NS = {"model": "m", "dtype": "bf16", "num_layers": 1, "num_kv_heads": 1, "head_size": 64}
VLLM = {"instance": "a", "endpoint": "tcp://x:1", "namespaces": [NS]}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"index.backend": "etcd"}, "backend"),
        ({"index.claim_ttl_s": 1, "index.probe_interval_s": 2}, "claim_ttl_s"),
        ({"index.vllm": [{**VLLM, "namespaces": []}]}, "namespaces"),
        ({"index.vllm": [{**VLLM, "namespaces": [{"model": "m"}]}]}, "dtype"),
        ({"index.vllm": [VLLM, VLLM]}, "unique"),
        ({"index.claim_ttl_s": 40, "index.max_claim_ttl_s": 30}, "max_claim_ttl_s"),
        ({"index.max_namespace_bytes": 10}, "max_namespace_bytes"),
        ({"index.source_grace_s": 0}, "source_grace_s"),
    ],
)
def test_bad_index_settings_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        load_config(**flags)
