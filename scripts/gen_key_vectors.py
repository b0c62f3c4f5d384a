"""Write docs/keys/vectors.json: test vectors of the chunk-key spec (docs/keys/spec.md, spec 3:
keys are SHA-256 truncated to 16 bytes) and docs/keys/fingerprint-vectors.json.

Run once when the spec changes (bumping its version); tests check the committed file against
the implementation and against the C reference in docs/keys/reference.c. Two cases put a
chain step's input (16 + 4 * chunk_tokens bytes) on SHA-256's padding edges, for
implementations that write their own SHA-256.
"""

import dataclasses
import json
from pathlib import Path

from kvtier.connector.fingerprint import config_fingerprint
from kvtier.core.keys import MediaItem, Namespace, prompt_keys, salt_digest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "keys"
OUT = DOCS / "vectors.json"
FINGERPRINTS = DOCS / "fingerprint-vectors.json"


HYBRID_PAGES = "kvtier-pages-v2;vllm;cuda;NHD;;bs32;page16384;kvdtype=auto"


def lcg_tokens(n: int, seed: int, vocab: int) -> list[int]:
    # A fixed generator so the vectors need no randomness source to be reproduced.
    out, state = [], seed
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((state >> 33) % vocab)
    return out


CASES = [
    (
        "tiny chunks, two full + partial",
        Namespace(
            model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=4
        ),
        list(range(11)),
    ),
    (
        "no full chunk",
        Namespace(
            model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=4
        ),
        [1, 2, 3],
    ),
    (
        "same tokens, other tenant",
        Namespace(
            model="m",
            dtype="float16",
            num_layers=2,
            num_kv_heads=2,
            head_size=64,
            chunk_tokens=4,
            cache_salt=salt_digest("tenant-b"),
        ),
        list(range(11)),
    ),
    (
        "extreme token ids",
        Namespace(
            model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=4
        ),
        [0, 4294967295, 65536, 255, 256, 1 << 31, 7, 4294967294],
    ),
    (
        "56-byte chain inputs: SHA-256 length padding spills into a second block",
        Namespace(
            model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=10
        ),
        list(range(1000, 1025)),
    ),
    (
        "64-byte chain inputs: exactly one SHA-256 block before padding",
        Namespace(
            model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=12
        ),
        lcg_tokens(36, seed=7, vocab=1 << 32),
    ),
    (
        "realistic namespace, 256-token chunks",
        Namespace(
            model="Qwen/Qwen3-8B",
            revision="b968826",
            dtype="bfloat16",
            num_layers=36,
            num_kv_heads=8,
            head_size=128,
            tp_rank=1,
            tp_size=2,
            lora="5f0c4e3b9d2a41e8a7c6b5d4e3f2a1b0",
            model_config_fp=config_fingerprint({"hf_config": {"model_type": "qwen3"}}),
            weights_fp="0123456789abcdef0123456789abcdef",
            tag="step-1200",
        ),
        lcg_tokens(3 * 256 + 100, seed=42, vocab=151936),
    ),
    (
        # the same tokens and model shape as the next vector: only the groups differ
        "hybrid model (sliding window + full attention): its groups are in kv_layout",
        Namespace(
            model="g",
            dtype="bfloat16",
            num_layers=4,
            num_kv_heads=2,
            head_size=64,
            kv_layout=f"{HYBRID_PAGES};groups=full/keep8*2,swa64/keep2*2",
            chunk_tokens=256,
        ),
        lcg_tokens(2 * 256, seed=3, vocab=262144),
    ),
    (
        "pure full-attention model, same tokens and shape",
        Namespace(
            model="g",
            dtype="bfloat16",
            num_layers=4,
            num_kv_heads=2,
            head_size=64,
            kv_layout=HYBRID_PAGES,
            chunk_tokens=256,
        ),
        lcg_tokens(2 * 256, seed=3, vocab=262144),
    ),
    (
        # Llama 4 geometry: three layers attend within 8,192-token spans, one globally
        "chunked local attention (Llama 4 geometry), same tokens and shape",
        Namespace(
            model="g",
            dtype="bfloat16",
            num_layers=4,
            num_kv_heads=2,
            head_size=64,
            kv_layout=f"{HYBRID_PAGES};groups=local8192/keep8*3,full/keep8*1",
            chunk_tokens=256,
        ),
        lcg_tokens(2 * 256, seed=3, vocab=262144),
    ),
    (
        # a Mamba hybrid's chunk also holds the recurrent state after its last token
        "Mamba hybrid (linear attention + full attention), same tokens and shape",
        Namespace(
            model="g",
            dtype="bfloat16",
            num_layers=4,
            num_kv_heads=2,
            head_size=64,
            kv_layout=f"{HYBRID_PAGES};groups=full/keep8*2,mamba/keep1*2;state-last",
            chunk_tokens=256,
        ),
        lcg_tokens(2 * 256, seed=3, vocab=262144),
    ),
    (
        # MLA's latent KV is the same on every TP rank: one namespace for every rank of a
        # stage (tp_rank 0), one per pipeline stage; the instance's TP size stays in it (TP
        # changes the bytes: another TP size never reads these chunks)
        "MLA, pipeline stage 1 of 2, one copy for the 8 ranks of a TP-8 instance",
        Namespace(
            model="deepseek-ai/DeepSeek-V3",
            dtype="bfloat16",
            num_layers=30,
            num_kv_heads=1,
            head_size=576,
            tp_rank=0,
            tp_size=8,
            pp_rank=1,
            pp_size=2,
            chunk_tokens=256,
        ),
        lcg_tokens(256, seed=5, vocab=129280),
    ),
]

SMALL = Namespace(
    model="m", dtype="float16", num_layers=2, num_kv_heads=2, head_size=64, chunk_tokens=4
)
# (name, namespace, tokens, multimodal items): keys of chunks over an item's placeholders
MEDIA_CASES = [
    (
        "an image's placeholders (5-10) key chunks 1 and 2 by the image",
        SMALL,
        [7] * 16,
        [MediaItem(5, 6, "image-a")],
    ),
    (
        "another image at the same positions: chunk 0 shared, chunks 1-3 not",
        SMALL,
        [7] * 16,
        [MediaItem(5, 6, "image-b")],
    ),
    (
        "two items in one chunk, a UTF-8 identifier with a line break",
        SMALL,
        [7] * 8,
        [MediaItem(1, 1, "a"), MediaItem(2, 1, "\u65e5\u672c\nx")],
    ),
]

SALTS = ["", "tenant-b", "tenant\nb\u00e9", "\U0001f510 key with spaces"]
CONFIGS = [
    {},
    {"hf_config": {"model_type": "llama", "rope_parameters": {"rope_theta": 10000.0}}},
    {"hf_config": {"model_type": "llama"}, "quantization": "fp8", "compute_dtype": "bfloat16"},
]


def vector(
    name: str, ns: Namespace, tokens: list[int], media: list[MediaItem] | None = None
) -> dict:
    """One test vector; ``media`` only where the prompt has multimodal items."""
    out = {
        "name": name,
        "namespace": ns.model_dump(),
        "canonical": ns.canonical_bytes().decode(),
        "root": ns.root_key().hex(),
        "tokens": tokens,
    }
    if media:
        out["media"] = [dataclasses.asdict(m) for m in media]
    out["keys"] = [k.hex() for k in prompt_keys(ns, tokens, media or ())]
    return out


def main() -> None:
    vectors = [vector(name, ns, tokens) for name, ns, tokens in CASES]
    vectors += [vector(name, ns, tokens, media) for name, ns, tokens, media in MEDIA_CASES]
    body = ",\n".join(json.dumps(v) for v in vectors)
    OUT.write_text(f"[\n{body}\n]\n")
    print(f"wrote {len(vectors)} vectors to {OUT}")
    fingerprints = {
        "salt_digest": [{"salt": salt, "digest": salt_digest(salt)} for salt in SALTS],
        "model_config": [
            {"config": config, "fingerprint": config_fingerprint(config)} for config in CONFIGS
        ],
    }
    FINGERPRINTS.write_text(json.dumps(fingerprints, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote fingerprint vectors to {FINGERPRINTS}")


if __name__ == "__main__":
    main()
