"""Chunk keys: the spec's vectors, determinism, edge cases (an independent C implementation and
other hash seeds, in other processes: tests/integration/test_keys_elsewhere.py)."""

from __future__ import annotations

import array
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.connector.fingerprint import config_fingerprint
from kvtier.core.keys import (
    KEY_BYTES,
    MediaItem,
    Namespace,
    PromptKeyer,
    chunk_keys,
    pack_keys,
    prompt_keys,
    salt_digest,
    unpack_keys,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "keys"
VECTORS = json.loads((DOCS / "vectors.json").read_text())
FINGERPRINTS = json.loads((DOCS / "fingerprint-vectors.json").read_text())
NS = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=4
)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_spec_vectors(vector: dict) -> None:
    ns = Namespace(**vector["namespace"])
    assert ns.canonical_bytes().decode() == vector["canonical"]
    assert ns.root_key().hex() == vector["root"]
    media = [MediaItem(**m) for m in vector.get("media", [])]
    assert [k.hex() for k in prompt_keys(ns, vector["tokens"], media)] == vector["keys"]


def test_keys_are_truncated_sha256_of_the_spec_formula() -> None:
    """Spec 3: root = SHA-256(domain || canonical)[:16], key_i = SHA-256(key_i-1 || u32le)[:16]."""
    root = hashlib.sha256(b"kvtier/ns/v3\n" + NS.canonical_bytes()).digest()[:16]
    assert NS.canonical_bytes().startswith(b"spec=3\n")
    assert NS.root_key() == root
    tokens = [0, 1, 0xFFFFFFFF, 1 << 31, 9, 8, 7, 6]
    expected, prev = [], root
    for i in range(0, len(tokens), 4):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[i : i + 4])
        prev = hashlib.sha256(prev + body).digest()[:16]
        expected.append(prev)
    assert prompt_keys(NS, tokens) == expected


def test_token_containers_agree() -> None:
    tokens = list(range(100, 140))
    expected = prompt_keys(NS, tokens)
    assert prompt_keys(NS, np.array(tokens, dtype=np.int64)) == expected
    assert prompt_keys(NS, np.array(tokens, dtype=np.uint32)) == expected
    assert prompt_keys(NS, array.array("I", tokens)) == expected
    assert prompt_keys(NS, tuple(tokens)) == expected


def test_only_full_chunks_and_prefix_property() -> None:
    a = prompt_keys(NS, list(range(10)))
    b = prompt_keys(NS, [*range(8), 99, 98, 97, 96])
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]  # same first 8 tokens, same first two keys
    c = prompt_keys(NS, [0, 1, 2, 3, 4, 5, 6, 9])
    assert c[0] == a[0] and c[1] != a[1]
    assert all(len(k) == KEY_BYTES for k in a + b + c)


def test_every_namespace_field_changes_the_keys() -> None:
    base = NS.model_dump()
    changes = {
        "model": "m2",
        "revision": "r",
        "dtype": "bfloat16",
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_size": 128,
        "kv_layout": "other",
        "tp_rank": 1,
        "tp_size": 2,
        "pp_rank": 1,
        "pp_size": 2,
        "chunk_tokens": 8,
        "cache_salt": "t",
        "lora": "a",
        "model_config_fp": "c",
        "weights_fp": "w",
        "tag": "step-2",
    }
    assert set(changes) == set(base)  # a new field must be added here too
    roots = {Namespace(**{**base, k: v}).root_key() for k, v in changes.items()}
    assert len(roots) == len(changes) and NS.root_key() not in roots


def test_incremental_keyer_matches_one_shot() -> None:
    tokens = list(range(1000))
    keyer = PromptKeyer(NS.root_key(), NS.chunk_tokens)
    for end in (3, 4, 9, 100, 1000):
        keyer.extend(tokens[:end])
    assert keyer.keys == prompt_keys(NS, tokens)
    assert chunk_keys(keyer.keys[9], tokens[40:], 4) == keyer.keys[10:]


@pytest.mark.parametrize("tokens", [[-1, 0, 0, 0], [1 << 32, 0, 0, 0]])
def test_out_of_range_tokens_are_rejected(tokens: list[int]) -> None:
    with pytest.raises(ValueError):
        prompt_keys(NS, tokens)
    with pytest.raises(ValueError):
        prompt_keys(NS, np.array(tokens, dtype=np.int64))


def test_bad_namespace_and_key_inputs() -> None:
    with pytest.raises(ValueError):
        Namespace(model="a\nb", dtype="f", num_layers=1, num_kv_heads=1, head_size=1)
    with pytest.raises(ValueError):
        Namespace(model="a", dtype="f", num_layers=0, num_kv_heads=1, head_size=1)
    with pytest.raises(ValueError):
        chunk_keys(b"short", [1, 2, 3, 4], 4)
    with pytest.raises(ValueError):
        unpack_keys(b"x" * 17)
    keys = prompt_keys(NS, list(range(12)))
    assert unpack_keys(pack_keys(keys)) == keys


def test_fingerprint_vectors() -> None:
    """The spec's salt digests and model-config fingerprints (docs/keys/spec.md)."""
    for case in FINGERPRINTS["salt_digest"]:
        assert salt_digest(case["salt"]) == case["digest"]
    for case in FINGERPRINTS["model_config"]:
        assert config_fingerprint(case["config"]) == case["fingerprint"]


def test_any_salt_works_and_salts_never_collide_with_their_digests() -> None:
    salts = ["", "a", "a\nb", "a\r\nb", "\u00e9", "\ud800", "x" * 10_000]
    digests = [salt_digest(salt) for salt in salts]
    assert len(set(digests)) == len(salts)
    for digest in digests[1:]:
        assert len(digest) == 32
        Namespace(
            model="m", dtype="f", num_layers=1, num_kv_heads=1, head_size=1, cache_salt=digest
        )


def test_keyer_truncate_recomputes_changed_chunks() -> None:
    keyer = PromptKeyer(NS.root_key(), NS.chunk_tokens)
    keyer.extend(list(range(12)))
    keyer.truncate(1)
    assert keyer.extend([*range(4), 9, 9, 9, 9, 8, 8, 8, 8]) == prompt_keys(
        NS, [*range(4), 9, 9, 9, 9, 8, 8, 8, 8]
    )
