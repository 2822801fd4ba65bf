"""Registration of the ``kvlab`` attention function in transformers' ``AttentionInterface``.

No model forward is patched: kvlab registers one attention function
(:func:`kvlab.engine.attention.kvlab_attention`) and selects it with
``model.set_attn_implementation`` (language model only; a vision tower keeps sdpa). A model whose
language model asks for attention kvlab does not implement is refused first
(:func:`check_attention_support`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from kvlab.config.errors import ConfigError
from kvlab.engine.attention import kvlab_attention
from kvlab.models.common import text_config

ATTENTION_NAME = "kvlab"


def register_attention() -> None:
    """Register the ``kvlab`` attention function with transformers (idempotent, no other side effect)."""
    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)


# Attention layer types (``config.layer_types``) kvlab implements.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _model_name(model: torch.nn.Module) -> str:
    """A readable name for error messages: the config's ``name_or_path`` or the class name."""
    return getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__


def check_attention_support(model: torch.nn.Module) -> None:
    """Refuse a model whose language model asks for attention kvlab does not implement.

    Checked on the language model's config: ``layer_types`` other than full/sliding attention
    (e.g. chunked or linear attention), ``attention_chunk_size`` (chunked local attention) and
    ``use_bidirectional_attention``. Sliding windows, logit soft-capping and attention sinks are
    implemented (see the module docstring).

    Raises:
        ConfigError: naming the model and the config argument.
    """
    config = text_config(model.config)
    name = _model_name(model)
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ConfigError(
            f"model {name!r}: layer_types {unsupported} are not supported by kvlab attention (only "
            f"{sorted(SUPPORTED_LAYER_TYPES)}); this model cannot run under kvlab."
        )
    for argument in ("attention_chunk_size", "use_bidirectional_attention"):
        if getattr(config, argument, None):
            raise ConfigError(
                f"model {name!r}: config argument {argument}={getattr(config, argument)!r} is not supported "
                "by kvlab attention; this model cannot run under kvlab."
            )


def enable_kvlab_attention(model: torch.nn.Module, vision_language: bool) -> None:
    """Route the language model's attention through kvlab; a vision tower keeps sdpa.

    Raises:
        ConfigError: the language model needs an attention feature kvlab does not implement
            (:func:`check_attention_support`); nothing is changed then.
    """
    check_attention_support(model)
    register_attention()
    if vision_language:
        model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    else:
        model.set_attn_implementation(ATTENTION_NAME)
