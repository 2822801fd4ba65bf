"""Tiny random-weight models of each attention variant (sliding windows, logit soft-capping, sinks),
built from transformers' own config classes, with the tokenizer and prompts the tests run them on."""

import functools

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import kvlab

WINDOW = 6
LENGTHS = (23, 17, 9)  # the longest prompts exceed the window many times over
STEPS = 4
SMALL = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(num_hidden_layers=2, **SMALL),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=2, **SMALL),
    "mistral-sliding": lambda: MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SMALL),
    "gemma2": lambda: Gemma2Config(
        num_hidden_layers=4,
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        **SMALL,
    ),
    "gemma3-text": lambda: Gemma3TextConfig(
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        **SMALL,
    ),
    "gpt-oss-sinks": lambda: GptOssConfig(
        num_hidden_layers=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        **SMALL,
    ),
}


@functools.cache
def tokenizer():
    """A 1024-token tokenizer with a pad token (tiny-qwen2's)."""
    return kvlab.load_model("tiny-qwen2").processor.tokenizer


def build(name: str) -> torch.nn.Module:
    """The family's tiny model with seeded random weights (sinks randomised too), fp32, eval, eager."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 1024, (n,), generator=g).tolist() for n in LENGTHS]
