"""Configs of the tiny random built-in models (hidden 64, head_dim 16, vocab 1024, 8192 positions;
``tiny-llama-long``: head_dim 64, 65536 positions).

These are for plumbing, shape and memory tests only: with random weights, quality metrics mean nothing.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, Qwen2Config

from kvlab.models.scaffolding.tokenizer import SPECIAL_TOKENS, TINY_VOCAB_SIZE
from kvlab.models.vlm import llava_config, qwen2_vl_config

TINY_HIDDEN = 64
TINY_HEAD_DIM = 16
TINY_MAX_POSITIONS = 8192
#: tiny-llama-long: K/V wide enough to be a visible part of a long prompt's process memory
LONG_LAYERS, LONG_HEADS, LONG_HEAD_DIM, LONG_MAX_POSITIONS = 8, 4, 64, 65536
#: image sizes of the tiny VLMs: 56x56 -> 4 Qwen2-VL tokens, 28x28 -> 4 LLaVA tokens
TINY_QWEN2VL_IMAGE = 56
TINY_LLAVA_IMAGE = 28

#: special token -> id in the tiny BPE (its first ids, in SPECIAL_TOKENS order)
TINY_TOKEN_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def text_dims(num_layers: int, num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    """Llama-style kwargs of a tiny language model over the tiny BPE."""
    return dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_HIDDEN,
        intermediate_size=2 * TINY_HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=TINY_MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=TINY_TOKEN_IDS["<|im_end|>"],
        pad_token_id=TINY_TOKEN_IDS["<|endoftext|>"],
    )


def tiny_llama_config() -> Any:
    """``LlamaConfig``: 2 layers, MHA with 4 heads / 4 KV heads."""
    return LlamaConfig(**text_dims(num_layers=2, num_heads=4, num_kv_heads=4))


def tiny_llama_long_config() -> Any:
    """``LlamaConfig`` of ``tiny-llama-long``: 8 layers, MHA with 4 heads / 4 KV heads of dim 64 over
    hidden 64, 65536 positions (RoPE theta 1e6). Its K/V is 2 KiB per token per layer in fp32 (64
    MiB per layer, 512 MiB over the layers at 32k tokens) while a forward's other activations stay
    those of hidden 64: the model for measuring what a long prompt's cache costs in process
    memory (``kvlab bench memory --prefill``), where the tiny models' K/V would vanish under the
    process's own few hundred MiB."""
    dims = text_dims(num_layers=LONG_LAYERS, num_heads=LONG_HEADS, num_kv_heads=LONG_HEADS)
    dims.update(head_dim=LONG_HEAD_DIM, max_position_embeddings=LONG_MAX_POSITIONS,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    return LlamaConfig(**dims)


def tiny_qwen2_config() -> Any:
    """``Qwen2Config``: 3 layers, GQA with 4 heads / 2 KV heads (q/k/v biases)."""
    dims = {k: v for k, v in text_dims(num_layers=3, num_heads=4, num_kv_heads=2).items() if k != "head_dim"}
    return Qwen2Config(**dims)


def tiny_qwen2_vl_config() -> Any:
    """``Qwen2VLConfig``: 2 text layers, 4 heads / 2 KV heads, M-RoPE [2, 3, 3], tiny vision tower."""
    return qwen2_vl_config(text_dims(2, 4, 2), TINY_TOKEN_IDS, mrope_section=[2, 3, 3])


def tiny_llava_config() -> Any:
    """``LlavaConfig``: Llama text model with 2 layers, 4 heads / 2 KV heads; tiny CLIP tower on 28x28."""
    return llava_config(text_dims(2, 4, 2), TINY_TOKEN_IDS, image_size=TINY_LLAVA_IMAGE)
