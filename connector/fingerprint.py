"""Fingerprints of what decides KV bytes beyond the geometry: the resolved model config, the
weight files, a LoRA adapter's weights.

Two engines may share chunks only if they compute the same KV for the same tokens. A model
*name* does not say that: the same name can be served quantized or not, with other rope
scaling (``hf_overrides``), from other weights (a fine-tune saved over the same path), and a
LoRA name can be reused for other adapter weights. So the namespace carries fingerprints
(docs/keys/spec.md, "Fingerprints"):

- ``model_config_fingerprint``: the engine's resolved model config (the HF config after
  ``hf_overrides``, quantization, compute dtype), as canonical JSON.
- ``files_fingerprint``: a directory of weights: every weight/metadata file's name, size and
  the XXH3-128 of all of its bytes. Sampling windows of each file was cheaper but blind: a
  fine-tune changing 4 of 50 tensors kept the fingerprint. A whole-file digest costs one read
  of the checkpoint (measured in docs/keys/spec.md: ~1 s per GB from disk, a few GB/s from
  the page cache) and is paid once per file version: digests are kept by (path, size, mtime,
  inode) in memory and in ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``), so a restart
  of an engine on the same files reads none of them.
  Weights changed in place *in memory* (RL weight sync) cannot be seen here: operators set
  ``weights_tag`` for that, or rely on the namespace bump at ``reset_prefix_cache``.

All fingerprints are 32 hex digits of XXH3-128. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

READ_BYTES = 16 << 20  # one read of a weight file while hashing it
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
    h = xxhash.xxh3_128(b"kvtier/weights/v2\n")
    for path in _weight_files(root):
        size = path.stat().st_size
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        h.update(f"{rel}\0{size}\0{FILE_DIGESTS.of(path)}\n".encode())
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


def hash_file(path: Path) -> str:
    """XXH3-128 of every byte of ``path`` (xxhash releases the GIL while it hashes)."""
    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


class FileDigests:
    """Whole-file digests kept by (path, size, mtime, inode): a file rewritten in place gets
    a new mtime (and usually a new inode), so it is hashed again; an unchanged file is hashed
    once per machine. The on-disk copy is a cache only: unreadable or corrupt, it is ignored.

    Thread-safe (one lock; hashing itself runs outside it)."""

    def __init__(self, cache_dir: Path | None) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, str] = {}
        self._file = cache_dir / "file-digests.json" if cache_dir is not None else None
        self._loaded = False

    @staticmethod
    def _key(path: Path) -> str:
        st = path.stat()
        return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"

    def of(self, path: Path) -> str:
        key = self._key(path)
        with self._lock:
            self._load()
            digest = self._digests.get(key)
        if digest is not None:
            return digest
        digest = hash_file(path)
        if self._key(path) != key:  # changed while being read: do not remember it
            return digest
        with self._lock:
            self._digests[key] = digest
            self._save()
        return digest

    def _load(self) -> None:
        if self._loaded or self._file is None:
            return
        self._loaded = True
        try:
            data = json.loads(self._file.read_text())
            if isinstance(data, dict):
                self._digests.update(
                    {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
                )
        except (OSError, ValueError):
            pass

    def _save(self) -> None:
        if self._file is None:
            return
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._file.parent, prefix=".file-digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(self._digests, f)
            os.replace(tmp, self._file)
        except OSError as exc:
            log.debug("kvtier: cannot keep file digests in %s: %s", self._file, exc)


def _cache_dir() -> Path | None:
    configured = os.environ.get("KVTIER_CACHE_DIR")
    if configured:
        return Path(configured)
    home = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(home) / "kvtier"


FILE_DIGESTS = FileDigests(_cache_dir())


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
    """LoRA adapter fingerprints by path (never by adapter name: a name can be reused for other
    weights), recomputed when a file's size, mtime or inode changes.

    Thread-safe: the lookup and alloc threads both resolve namespaces."""

    def __init__(self, limit: int = 256) -> None:
        self._cache: dict[str, tuple[tuple[tuple[str, int, int, int], ...], str]] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def of(self, adapter_path: str) -> str:
        root = Path(adapter_path)
        stamp = tuple(
            (p.name, st.st_size, st.st_mtime_ns, st.st_ino)
            for p in _weight_files(root)
            for st in (p.stat(),)
        )
        if not stamp:
            raise FileNotFoundError(f"no adapter weights under {adapter_path}")
        with self._lock:
            cached = self._cache.get(adapter_path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        fingerprint = files_fingerprint(root)
        with self._lock:
            if len(self._cache) >= self._limit:
                self._cache.pop(next(iter(self._cache)))
            self._cache[adapter_path] = (stamp, fingerprint)
        return fingerprint
