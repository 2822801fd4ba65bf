"""A user's own transformers model and tokenizer as a :class:`~kvlab.models.base.LoadedModel`."""

from __future__ import annotations

from typing import Any

import torch

from kvlab.config.errors import ConfigError
from kvlab.models.base import LoadedModel
from kvlab.models.info import model_info
from kvlab.models.processors import ChatProcessor
from kvlab.models.vlm import image_adapter


def wrap_model(
    model: torch.nn.Module,
    tokenizer: Any,
    image_processor: Any = None,
    *,
    name: str | None = None,
    chat_template: str = "auto",
) -> LoadedModel:
    """``model`` with kvlab's processor and facts around it, in eval mode; weights, device and dtype
    untouched. Its attention is not routed through kvlab here (:func:`kvlab.wrap_model` does that).

    Args:
        model: a ``*ForCausalLM``, or a Qwen2-VL / Qwen2.5-VL / LLaVA ``*ForConditionalGeneration``
            (or a family of :data:`~kvlab.models.vlm.FAMILY_PROCESSORS`).
        tokenizer: its tokenizer.
        image_processor: vision-language models only: the family's ``*ImageProcessorPil`` (or the
            family's transformers processor); None takes the family's defaults.
        name: the model's name; default: ``model.config.name_or_path`` or the class name.
        chat_template: ``auto``, ``none`` or the path of a Jinja template file, as ``data.chat_template``.

    Raises:
        ConfigError: not a transformers model, a vision-language family kvlab cannot feed images
            to, a vision-language model without a chat template, or a tokenizer with neither a pad
            nor an eos token.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ConfigError(
            f"wrap_model needs a transformers model (an nn.Module with .config), got {model!r}."
        )
    config = model.config
    name = name or getattr(config, "name_or_path", "") or type(model).__name__
    info = model_info(config, name)
    images = image_adapter(config, image_processor) if info.vision_language else None
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
    processor = ChatProcessor(
        tokenizer, info.image_token_ids, info.video_token_ids, images, eos, chat_template=chat_template
    )
    processor.check_template()
    model.eval()
    return LoadedModel(model, processor, info, source="wrapped", dtype=next(model.parameters()).dtype)
