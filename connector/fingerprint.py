"""Fingerprints of what decides KV bytes beyond the geometry: the resolved model config, the
weight files, a LoRA adapter's weights.

Two engines may share chunks only if they compute the same KV for the same tokens. A model
*name* does not say that: the same name can be served quantized or not, with other rope
scaling (``hf_overrides``), from other weights (a fine-tune saved over the same path), and a
LoRA name can be reused for other adapter weights. So the namespace carries fingerprints
(docs/keys/spec.md, "Fingerprints"):

- ``model_config_fingerprint``: the engine's resolved model config (the HF config after
  ``hf_overrides``, quantization, compute dtype), as canonical JSON.
- ``files_fingerprint``: a directory of weights: every weight/metadata file's name and size,
  the whole of each small metadata file (configs, safetensors indexes, adapter configs), each
  safetensors header (dtypes, shapes, offsets) and ``SAMPLES`` evenly spaced 64 KiB windows of
  every large file's bytes. Reading a few MB per model keeps start-up cheap while a fine-tune
  written over the same files (same names, sizes and headers, other values) still changes it.
  Weights changed in place *in memory* (RL weight sync) cannot be seen here: operators set
  ``weights_tag`` for that, or rely on the namespace bump at ``reset_prefix_cache``.

All fingerprints are 32 hex digits of XXH3-128. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

SAMPLES = 8  # windows sampled per large weight file
WINDOW = 64 << 10
SMALL_FILE = 1 << 20  # metadata files up to this size are hashed whole
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
METADATA_SUFFIXES = (".json", ".model", ".txt", ".yaml", ".yml")
# HF config keys that name or date the file rather than describe the model
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, non-JSON values as their repr (stable across runs)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr).encode()


def config_fingerprint(config: dict[str, Any]) -> str:
    """Fingerprint of a resolved model config (a dict: see ``model_config_fingerprint``)."""
    return xxhash.xxh3_128_hexdigest(b"kvtier/model-config/v1\n" + canonical_json(config))


def model_config_fingerprint(vllm_config: Any) -> str:
    """The model config as this vLLM resolved it: what changes the KV a model computes."""
    model = vllm_config.model_config
    hf_config = model.hf_config
    hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    resolved = {
        "hf_config": {k: v for k, v in hf.items() if k not in VOLATILE_CONFIG_KEYS},
        "hf_overrides": _plain(getattr(model, "hf_overrides", None)),
        "quantization": str(getattr(model, "quantization", None) or ""),
        "compute_dtype": str(getattr(model, "dtype", "")).removeprefix("torch."),
        "override_attention_dtype": str(getattr(model, "override_attention_dtype", None) or ""),
    }
    return config_fingerprint(resolved)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    return repr(value)  # a callable override: its identity is the best available


def files_fingerprint(root: Path) -> str:
    """Fingerprint of a directory of weights (or one weight file). See the module docstring."""
    h = xxhash.xxh3_128(b"kvtier/weights/v1\n")
    for path in _weight_files(root):
        size = path.stat().st_size
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        h.update(f"{rel}\0{size}\n".encode())
        with path.open("rb") as f:
            if size <= SMALL_FILE and path.suffix in METADATA_SUFFIXES:
                h.update(f.read())
                continue
            if path.suffix == ".safetensors":
                h.update(_safetensors_header(f, size))
            for offset in _sample_offsets(size):
                f.seek(offset)
                h.update(f.read(WINDOW))
    return h.hexdigest()


def _weight_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    wanted = WEIGHT_SUFFIXES + METADATA_SUFFIXES
    files = [
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in wanted and not any(part.startswith(".") for part in p.parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _safetensors_header(f: Any, size: int) -> bytes:
    if size < 8:
        return b""
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(min(length, size - 8, 100 << 20))


def _sample_offsets(size: int) -> Iterable[int]:
    if size <= WINDOW * SAMPLES:
        return range(0, size, WINDOW)
    step = (size - WINDOW) // (SAMPLES - 1)
    return (i * step for i in range(SAMPLES))


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """Fingerprint of the weights vLLM serves for ``model``: a local path directly, a hub id
    through its snapshot in the local HF cache. '' (and a warning) when neither is readable:
    the namespace then relies on the model name and revision alone."""
    path = Path(model)
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception as exc:
            log.warning(
                "kvtier: cannot read the weights of %s to fingerprint them (%s); chunk keys "
                "identify them by name and revision only: set weights_tag if they change",
                model,
                type(exc).__name__,
            )
            return ""
    return files_fingerprint(path)


class AdapterFingerprints:
    """LoRA adapter fingerprints by path, recomputed when a file's size or mtime changes.

    Not thread-safe: one per connector, used from its lookup path."""

    def __init__(self, limit: int = 256) -> None:
        self._cache: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}
        self._limit = limit

    def of(self, adapter_path: str) -> str:
        root = Path(adapter_path)
        stamp = tuple(
            (p.name, st.st_size, st.st_mtime_ns) for p in _weight_files(root) for st in (p.stat(),)
        )
        if not stamp:
            raise FileNotFoundError(f"no adapter weights under {adapter_path}")
        cached = self._cache.get(adapter_path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        fingerprint = files_fingerprint(root)
        if len(self._cache) >= self._limit:
            self._cache.pop(next(iter(self._cache)))
        self._cache[adapter_path] = (stamp, fingerprint)
        return fingerprint
