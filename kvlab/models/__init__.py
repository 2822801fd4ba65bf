"""Models for kvlab: built-in tiny and SmolLM2-based models, plus local directories and Hub ids.

Public API::

    MODELS                      # Registry of built-in model builders (YAML field model.model)
    load_model(name, dtype)     # -> LoadedModel(model, processor, info, source, path, ...)
    load_processor(name)        # -> Processor (cached per name; no weights loaded)
    wrap_model(model, tokenizer) # -> LoadedModel around a user's transformers model
    model_info(config, name)    # -> ModelInfo from an HF config
    context_length(name)        # -> max_position_embeddings, read without weights
    validate_model_name(name)   # ConfigError early for unknown names
    PROCESSORS                  # the above as the processor source datasets measure tokens with

``name`` is a built-in name (see :mod:`kvlab.models.builtin`), an existing local directory with
an HF ``config.json``, or a Hub id ``org/name``.
"""

from __future__ import annotations

import functools
import time

import torch
from PIL import Image

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.models import hub
from kvlab.models.base import IMAGE, PAD, TEXT, VIDEO, LoadedModel, ModelInfo, Processor, PromptProcessor
from kvlab.models.builtin import MODELS, BuiltinModel
from kvlab.models.common import resolve_dtype
from kvlab.models.info import model_info
from kvlab.models.placement import DeviceMap, dispatch, validate_device_map
from kvlab.models.processors import ChatProcessor
from kvlab.models.wrap import wrap_model

__all__ = [
    "IMAGE",
    "MODELS",
    "PAD",
    "PROCESSORS",
    "TEXT",
    "VIDEO",
    "BuiltinModel",
    "ChatProcessor",
    "LoadedModel",
    "ModelInfo",
    "Processor",
    "PromptProcessor",
    "load_model",
    "context_length",
    "load_processor",
    "model_info",
    "validate_model_dtype",
    "validate_model_name",
    "wrap_model",
]


def validate_model_dtype(name: str, dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` resolved, or :class:`ConfigError` when the built-in ``name`` cannot be built in it
    faithfully (``BuiltinModel.dtypes``: ``smollm2-reader`` is float32 only). Loads nothing."""
    torch_dtype = resolve_dtype(dtype)
    allowed = MODELS.get(name).dtypes if name in MODELS else None
    if allowed is not None and torch_dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ConfigError(
            f"model.dtype {str(torch_dtype).removeprefix('torch.')} is not supported by the built-in "
            f"'{name}' (supported: {names}; see docs/models.md). Set model.dtype: {names.split(',')[0]}."
        )
    return torch_dtype


def validate_model_name(name: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a built-in, a saved-model directory or ``org/name``.

    Loads nothing (a Hub id is only checked for its shape).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"model.model must be a non-empty string, got {name!r}. Built-ins: {_builtins()}.")
    if name in MODELS:
        return
    path = hub.local_dir(name)
    if path is not None:
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.model '{name}' is a directory without a config.json, so it is not a saved HF model. "
                f"Point it at a directory written by save_pretrained(), or use a built-in: {_builtins()}."
            )
        return
    if hub.is_hub_id(name):
        return
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1:
        raise ConfigError(
            f"model.model '{name}' looks like a path, but no such directory exists. Fix the path, or use a "
            f"built-in model: {_builtins()}."
        )
    raise ConfigError(
        f"Unknown model '{name}' in model.model.{did_you_mean(name, MODELS.names())} It is not a built-in, "
        f"an existing directory, or a Hub id of the form 'org/name'. Built-in models: {_builtins()}. "
        "Run `kvlab list` to see them with descriptions."
    )


def _builtins() -> str:
    return ", ".join(MODELS.names())


@functools.cache
def load_processor(name: str) -> Processor:
    """The kvlab processor of model ``name``, cached per name (the same object ``load_model`` returns).

    Cheap: builds only the tokenizer and image processor (for ``smollm2-*`` it may convert the
    GGUF once, ~40 s, to reach the tokenizer).
    """
    validate_model_name(name)
    if name in MODELS:
        return MODELS.get(name)().processor()
    return hub.load_processor(name)


class ModelProcessors:
    """kvlab's models as the :class:`~kvlab.data.tokens.ProcessorSource` of the datasets
    that measure lengths in tokens: names checked by :func:`validate_model_name`, processors from
    :func:`load_processor` (looked up when called)."""

    def check(self, name: str) -> None:
        validate_model_name(name)

    def load(self, name: str) -> Processor:
        return load_processor(name)


#: the processor source kvlab passes to datasets (``build_dataset(..., processors=PROCESSORS)``)
PROCESSORS = ModelProcessors()


def load_model(
    name: str, dtype: str | torch.dtype = "float32", device_map: DeviceMap | None = None
) -> LoadedModel:
    """Load model ``name`` in ``dtype`` (eval mode, ``attn_implementation="sdpa"``).

    ``device_map`` (None: the model stays on the CPU) spreads it over devices: passed to
    ``from_pretrained`` for a directory or Hub id; a built-in is built on the CPU and then
    dispatched with accelerate (:func:`kvlab.models.placement.dispatch`). ``device_map`` of the
    result records the resolved map.

    Returns a :class:`LoadedModel` whose ``info`` describes the language model, with its
    ``source`` ("builtin" / "pretrained"), ``path``, ``dtype``, ``load_seconds`` and, for built-in
    VLMs, ``image_size`` and ``tokens_per_image``.
    """
    validate_model_name(name)
    validate_device_map(device_map)
    torch_dtype = validate_model_dtype(name, dtype)
    start = time.perf_counter()
    processor = load_processor(name)
    if name in MODELS:
        builder = MODELS.get(name)()
        model = builder.build(torch_dtype)
        if device_map is not None:
            model = dispatch(model, device_map, torch_dtype)
        origin = builder.origin()
    else:
        model = hub.load_model(name, torch_dtype, device_map)
        origin = {"source": "pretrained", "path": str(hub.local_dir(name) or name)}
    info = model_info(model.config, name)
    images = processor.images if isinstance(processor, PromptProcessor) else None
    if images is not None and origin.get("image_size"):
        size = origin["image_size"]
        origin["tokens_per_image"] = images.process([Image.new("RGB", (size, size))])[1][0]
    if device_map is not None:
        # from_pretrained dispatches (and records hf_device_map) only over several devices
        resolved = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
        origin["device_map"] = {module: str(device) for module, device in resolved.items()}
    seconds = time.perf_counter() - start
    return LoadedModel(model, processor, info, dtype=torch_dtype, load_seconds=seconds, **origin)


def context_length(name: str) -> int | None:
    """The model's context (``max_position_embeddings`` of its config), read without weights;
    None when ``name`` is neither a built-in, a local directory nor a Hub id."""
    if name in MODELS:
        config = MODELS.get(name)().config()
    elif hub.local_dir(name) is not None or hub.is_hub_id(name):
        config = hub.load_config(name)
    else:
        return None
    return model_info(config, name).max_position_embeddings
