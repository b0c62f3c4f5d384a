"""Canonical chunk keys: the name of a piece of KV cache everywhere in the cluster.

The spec lives in docs/keys/spec.md (with test vectors in docs/keys/vectors.json); this module
is its reference implementation. In short (spec 3):

    root  = SHA-256(b"kvtier/ns/v3\\n" + namespace.canonical_bytes())[:16]
    key_i = SHA-256(key_{i-1} || u32le(tokens[i*C : (i+1)*C]))[:16]      key_{-1} = root

Keys are 16-byte ``bytes``: the first 16 bytes of the SHA-256 digest. SHA-256 (spec 3; spec 2
used XXH3-128) so that a crafted prompt cannot take another prompt's key within a namespace
(second preimage ~2^128 work; two crafted prompts colliding with each other ~2^64, the generic
bound for 16 bytes). Only full chunks are keyed. Nothing here depends on ``PYTHONHASHSEED`` or
on the process: a router written in another language computes the same keys from token ids
alone. Salt digests and fingerprints stay XXH3-128 (see the spec).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvtier.core.errors import ErrorCode, KvtierError

KEY_BYTES = 16
NAMESPACE_DOMAIN = b"kvtier/ns/v3\n"
SPEC_VERSION = 3
SALT_DOMAIN = b"kvtier/salt/v2\n"

ChunkKey = bytes  # 16 bytes

_TOKEN_LIMIT = 1 << 32

# Bounds on a namespace definition. Not part of the key spec (no key of a definition within
# them changes): they refuse definitions no engine makes. Every store and index keeps each
# registered definition in memory, and ``max_namespaces`` bounds their count, not their size:
# unbounded, five 40 MiB definitions grew a store by 234 MiB (docs/security.md, "Limits").
MAX_NAME_BYTES = 512  # model, revision, kv_layout, tag: names, paths, composite descriptions
MAX_FIELD_BYTES = 128  # dtype, cache_salt and the fingerprints: short by construction
MAX_NAMESPACE_INT = (1 << 31) - 1  # layers, heads, sizes, ranks, chunk tokens
MAX_NAMESPACE_JSON_BYTES = 16 << 10  # a registration's JSON, checked before it is parsed
_NAME_FIELDS = frozenset({"model", "revision", "kv_layout", "tag"})


class Namespace(BaseModel):
    """Everything that makes two pieces of KV cache incompatible.

    Two engines share chunks only if every field here is equal. The field order below is part
    of the spec (it is the order of ``canonical_bytes``); append new fields at the end only,
    bumping ``SPEC_VERSION``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="model name as served, e.g. 'Qwen/Qwen3-8B'")
    revision: str = Field("", description="model revision / weights hash")
    dtype: str = Field(description="KV cache dtype, e.g. 'bfloat16', 'fp8_e4m3'")
    num_layers: int = Field(ge=1, description="attention layers whose KV this rank holds")
    num_kv_heads: int = Field(ge=1, description="KV heads held by this rank")
    head_size: int = Field(ge=1)
    kv_layout: str = Field(
        "kvtier-chunk-v1", description="byte layout of one chunk (see docs/chunk-layout.md)"
    )
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    pp_rank: int = Field(0, ge=0)
    pp_size: int = Field(1, ge=1)
    chunk_tokens: int = Field(256, ge=1)
    cache_salt: str = Field(
        "",
        description="tenant isolation: salt_digest() of the request's cache_salt ('' for none); "
        "chunks never match across salts, and the salt itself never leaves the engine",
    )
    lora: str = Field(
        "", description="fingerprint of the LoRA adapter's weights (not its name), '' for none"
    )
    # spec 2: what the weights are, not only what they are called
    model_config_fp: str = Field(
        "", description="fingerprint of the model config as the engine resolved it"
    )
    weights_fp: str = Field("", description="fingerprint of the weight files")
    tag: str = Field(
        "",
        description="operator's tag for weights changed in place (e.g. the training step), "
        "plus '#gen=N' after a namespace bump",
    )

    @field_validator("*", mode="after")
    @classmethod
    def _single_line(cls, value: Any) -> Any:
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            raise ValueError("namespace fields must not contain line breaks")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a field past its bound (``MAX_NAME_BYTES``, ``MAX_FIELD_BYTES``,
        ``MAX_NAMESPACE_INT``), with an error that names the field and its bound."""
        name = info.field_name
        if isinstance(value, str):
            limit = MAX_NAME_BYTES if name in _NAME_FIELDS else MAX_FIELD_BYTES
            size = len(value.encode("utf-8", "surrogatepass"))
            if size > limit:
                raise ValueError(f"namespace field {name} is {size} bytes, at most {limit}")
        elif isinstance(value, int) and value > MAX_NAMESPACE_INT:
            raise ValueError(f"namespace field {name} is at most {MAX_NAMESPACE_INT}")
        return value

    def canonical_bytes(self) -> bytes:
        """UTF-8 ``name=value\\n`` lines in field-declaration order (the spec's encoding)."""
        lines = [f"spec={SPEC_VERSION}"]
        lines += [f"{name}={getattr(self, name)}" for name in type(self).model_fields]
        return ("\n".join(lines) + "\n").encode()

    def root_key(self) -> ChunkKey:
        return key_digest(NAMESPACE_DOMAIN + self.canonical_bytes())


def key_digest(data: bytes | memoryview) -> ChunkKey:
    """The spec's hash: the first 16 bytes of SHA-256(``data``). A chain step is
    ``key_digest(parent + u32le(chunk tokens))``; code that keys chunks outside this module
    (e.g. from engine events) must use this, not its own hash."""
    return hashlib.sha256(data).digest()[:KEY_BYTES]


def salt_digest(salt: str | None) -> str:
    """The namespace's ``cache_salt`` value for a request's salt: 32 hex digits of
    SHA-256(b"kvtier/salt/v2\\n" + UTF-8 salt)[:16], '' for no salt. Any string vLLM accepts
    works (line breaks, any Unicode), and no store, index or log ever sees the salt itself. A
    cryptographic hash: a salt crafted to collide with another tenant's digest would put its
    requests in that tenant's namespace (spec 2 used XXH3-128, not built to resist that)."""
    if not salt:
        return ""
    raw = salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(SALT_DOMAIN + raw).digest()[:KEY_BYTES].hex()


def token_bytes(tokens: Sequence[int] | Any) -> memoryview:
    """Little-endian uint32 bytes of ``tokens`` (a list, array or numpy/torch-like array):
    what a chunk's key hashes."""
    if isinstance(tokens, array.array) and tokens.typecode == "I" and tokens.itemsize == 4:
        packed = tokens
    elif hasattr(tokens, "astype") and hasattr(tokens, "tobytes"):  # numpy
        arr: Any = tokens
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT):
            raise ValueError("token ids must be in [0, 2**32)")
        return memoryview(arr.astype("<u4", copy=False).tobytes())
    else:
        try:
            packed = array.array("I", tokens)
        except OverflowError as exc:
            raise ValueError("token ids must be in [0, 2**32)") from exc
        if packed.itemsize != 4:  # pragma: no cover - every platform we support has 4-byte I
            raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed = array.array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")


@dataclass(frozen=True)
class MediaItem:
    """A multimodal item of a prompt (an image, an audio clip): the placeholder tokens it
    occupies, ``[offset, offset + length)``, and what it is (vLLM's ``mm_feature.identifier``:
    a digest of the item's content, or the uuid the client gave it)."""

    offset: int
    length: int
    identifier: str


MEDIA_TAG = b"kvtier/mm/v1\n"


def media_extra(items: Sequence[MediaItem], start: int, end: int) -> bytes:
    """What chunk ``[start, end)`` adds to its key for the items whose placeholders it
    overlaps: nothing without any (text keys stay spec 3's), else ``MEDIA_TAG`` and, per
    item by offset, ``"{offset} {length} {n}:{identifier}\n"`` (``n``: the identifier's UTF-8
    byte count, so no identifier can end another's line)."""
    touching = sorted(
        (i for i in items if i.offset < end and i.offset + i.length > start),
        key=lambda i: (i.offset, i.length, i.identifier),
    )
    if not touching:
        return b""
    out = bytearray(MEDIA_TAG)
    for item in touching:
        ident = item.identifier.encode()
        out += f"{item.offset} {item.length} {len(ident)}:".encode() + ident + b"\n"
    return bytes(out)


def chunk_keys(
    parent: ChunkKey,
    tokens: Sequence[int] | Any,
    chunk_tokens: int,
    max_chunks: int | None = None,
    media: Sequence[MediaItem] = (),
    first_chunk: int = 0,
) -> list[ChunkKey]:
    """Keys of the full chunks of ``tokens``, chained from ``parent``.

    ``parent`` is the namespace root for a prompt's first chunk, or the key of the chunk just
    before ``tokens`` to continue a chain (``first_chunk``: that chunk's index + 1, which
    places ``media``'s offsets). A trailing partial chunk gets no key.
    """
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    n_chunks = len(tokens) // chunk_tokens
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        return []
    data = token_bytes(tokens[: n_chunks * chunk_tokens])
    step = chunk_tokens * 4
    keys: list[ChunkKey] = []
    prev = parent
    sha256 = hashlib.sha256
    for index, off in enumerate(range(0, n_chunks * step, step)):
        # update() instead of ``prev + chunk``: no copy of the chunk (measured ~5 % faster)
        h = sha256(prev)
        h.update(data[off : off + step])
        if media:
            start = (first_chunk + index) * chunk_tokens
            h.update(media_extra(media, start, start + chunk_tokens))
        prev = h.digest()[:KEY_BYTES]
        keys.append(prev)
    return keys


def prompt_keys(
    namespace: Namespace, tokens: Sequence[int] | Any, media: Sequence[MediaItem] = ()
) -> list[ChunkKey]:
    """Keys of every full chunk of a prompt (and its multimodal items) in ``namespace``."""
    return chunk_keys(namespace.root_key(), tokens, namespace.chunk_tokens, media=media)


class PromptKeyer:
    """Incremental keys for a prompt that grows (agentic turns, decode): hashes each chunk once.

    Not thread-safe; one per request.
    """

    def __init__(self, root: ChunkKey, chunk_tokens: int) -> None:
        self._root = root
        self._chunk_tokens = chunk_tokens
        self.keys: list[ChunkKey] = []

    def extend(
        self, tokens: Sequence[int] | Any, media: Sequence[MediaItem] = ()
    ) -> list[ChunkKey]:
        """Keys for all full chunks of ``tokens`` (the whole prompt so far, not a delta) and
        its multimodal items."""
        done = len(self.keys)
        start = done * self._chunk_tokens
        parent = self.keys[-1] if self.keys else self._root
        self.keys += chunk_keys(
            parent, tokens[start:], self._chunk_tokens, media=media, first_chunk=done
        )
        return self.keys

    def truncate(self, chunks: int) -> None:
        """Forget keys past the first ``chunks`` (their tokens may change)."""
        del self.keys[chunks:]


def keys_from_hex(values: Iterable[str]) -> list[ChunkKey]:
    out = []
    for value in values:
        key = bytes.fromhex(value)
        if len(key) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits)")
        out.append(key)
    return out


def check_keys(keys: Iterable[bytes]) -> None:
    """Refuse (INVALID_ARGUMENT) anything that is not a chunk key, before it reaches a table."""
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise KvtierError(
                ErrorCode.INVALID_ARGUMENT, f"a chunk key is {KEY_BYTES} bytes, got {key!r:.40}"
            )


def pack_keys(keys: Sequence[ChunkKey]) -> bytes:
    """Concatenate keys for the wire (the control APIs carry keys as one bytes field)."""
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
    return b"".join(keys)


def unpack_keys(blob: bytes) -> list[ChunkKey]:
    if len(blob) % KEY_BYTES:
        raise ValueError(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(blob)}")
    return [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]
