"""A tiny random vision-language model that vLLM's CPU build runs with images, made locally.

Idefics3 (a SigLIP-style vision tower, a pixel-shuffle connector and a Llama text model): of
the vision-language models vLLM 0.32 implements, its code and its transformers processor need
no torchvision (LLaVA's imports Pixtral's torchvision image processor, and PyPI's torchvision
wheels are CUDA builds that do not load against the CPU torch). Image splitting is off: every
image is resized to ``image_size`` square, and the one image token in a prompt becomes
``<fake_token_around_image> <global-img>``, ``IMAGE_TOKENS`` x ``<image>`` and
``<fake_token_around_image>`` (``IMAGE_SPAN`` tokens).
"""

from __future__ import annotations

from pathlib import Path

from kvtier.testing.models import _tokenizer, llama_config, scale_weights

VISION_SPECIALS = (
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)
IMAGE_TOKEN_ID = 4  # "<image>": the first id after the four base specials
FIRST_TEXT_ID = 4 + len(VISION_SPECIALS)  # "t0"
IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 112, 14, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 16
IMAGE_SPAN = IMAGE_TOKENS + 3  # what one image token in a prompt becomes

# each message framed by <s> ... </s> (as the text models' template), an image part "<image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s> ' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url', 'image_pil') %}{{ '<image> ' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}{{ ' </s> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>' }}{% endif %}"
)


def make_tiny_idefics3(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write the model, tokenizer and processor to ``out_dir`` (once) and return it; text
    model as ``make_tiny_llama``'s tiny preset (2 layers, 2 KV heads of 32), fp32, weights
    scaled x5 like every test model's."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    text = llama_config(vocab_size=vocab_size)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=SCALE_FACTOR,
        image_token_id=IMAGE_TOKEN_ID,
        tie_word_embeddings=False,
        pad_token_id=3,
    )
    config.dtype = "float32"
    model = Idefics3ForConditionalGeneration(config)
    scale_weights(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=_tokenizer(vocab_size, VISION_SPECIALS),
        image_seq_len=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json, for older readers too
    return out
