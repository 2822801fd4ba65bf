"""Tokenizers without the Hub: a byte-level BPE trained at runtime, ChatML chat templates, special tokens.

The tiny built-in models share one tokenizer: a byte-level BPE (vocab 1024) trained on CPython's
bundled ``pydoc_data.topics`` text with the ``tokenizers`` library (deterministic, ~0.2 s, cached
per process). Its first ids are the special tokens in :data:`SPECIAL_TOKENS` order.
"""

from __future__ import annotations

import functools
from pydoc_data.topics import topics
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

#: chat and vision special tokens, in id order for the tiny BPE (``<|endoftext|>`` = 0, ...)
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
)
#: the vision tokens that the grafted SmolLM2 VLMs add to SmolLM2's tokenizer
VISION_TOKENS: tuple[str, ...] = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
)

TINY_VOCAB_SIZE = 1024

#: what one ``{"type": "image"}`` content entry renders to, per placeholder style
IMAGE_PLACEHOLDERS: dict[str, str] = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>",
}


def chatml_template(image_placeholder: str = "", default_system: str | None = None) -> str:
    """A ChatML Jinja template.

    ``content`` may be a string or a list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}``
    entries; each image entry renders ``image_placeholder``. With ``default_system``, a system turn
    with that text is inserted when the conversation does not start with one (as SmolLM2's own
    template does).
    """
    image = image_placeholder.replace("'", "\\'")
    lines = ["{%- for message in messages %}"]
    if default_system is not None:
        system = default_system.replace("'", "\\'")
        lines.append(
            "{%- if loop.first and message['role'] != 'system' %}"
            f"{{{{ '<|im_start|>system\\n{system}<|im_end|>\\n' }}}}"
            "{%- endif %}"
        )
    lines += [
        "{{- '<|im_start|>' + message['role'] + '\\n' }}",
        "{%- if message['content'] is string %}{{- message['content'] }}",
        "{%- else %}{%- for part in message['content'] %}",
        f"{{%- if part['type'] == 'image' %}}{{{{- '{image}' }}}}",
        "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
        "{%- endfor %}{%- endif %}",
        "{{- '<|im_end|>\\n' }}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    ]
    return "\n".join(lines)


@functools.cache
def _trained_bpe() -> Any:
    """The raw ``tokenizers.Tokenizer`` (trained once per process; never mutate it)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    return bpe


def tiny_tokenizer(image_placeholder: str = "", named_tokens: dict[str, str] | None = None) -> Any:
    """A fresh ``PreTrainedTokenizerFast`` over the tiny BPE, with a ChatML template.

    eos = ``<|im_end|>``, pad = ``<|endoftext|>``, no bos. A new wrapper per call (cheap), so callers
    may set attributes on it; the trained BPE underneath is shared.

    Args:
        image_placeholder: what the chat template writes for one image.
        named_tokens: the tokenizer's named special tokens (``tokenizer.image_token`` and the like;
            tokens not in the BPE are added), default Qwen2-VL's ``image_token`` / ``video_token``.
            Family processors read them: LLaVA-NeXT's ``image_token``, Gemma 3's ``boi_token``.
    """
    bpe = Tokenizer.from_str(_trained_bpe().to_str())
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=named_tokens or {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        chat_template=chatml_template(image_placeholder),
    )


def add_vision_tokens(tokenizer: Any, image_placeholder: str, default_system: str | None) -> list[int]:
    """Add :data:`VISION_TOKENS` (as special tokens) and a list-aware ChatML template; returns the new ids.

    Used to turn SmolLM2's tokenizer into a VLM tokenizer. Text without those tokens tokenizes
    exactly as before.
    """
    before = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = chatml_template(image_placeholder, default_system)
    return list(range(before, len(tokenizer)))
