"""kvlab: KV-cache compression for language and vision-language models, composed in YAML.

The public Python API (guide: ``docs/api.md``)::

    import kvlab

    pipeline = kvlab.load_pipeline("snapkv", {"budget.tokens": 64})
    model = kvlab.load_model("tiny-qwen2")          # or kvlab.wrap_model(hf_model, tokenizer)
    outputs = kvlab.compress_and_generate(model, pipeline, ["Hello!"], max_new_tokens=16)

The names below are the stable API; everything in the subpackages is internal and may move.
They are imported on first use, so ``import kvlab`` stays cheap (the CLI starts fast).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.api import (
        Output,
        compress_and_generate,
        compression_config,
        load_model,
        load_pipeline,
        wrap_model,
    )
    from kvlab.config.errors import ConfigError
    from kvlab.config.loader import preset_names as presets
    from kvlab.models.base import LoadedModel, ModelInfo
    from kvlab.pipeline import Pipeline

#: public name -> module that defines it
_EXPORTS = {
    "load_pipeline": "kvlab.api",
    "compression_config": "kvlab.api",
    "load_model": "kvlab.api",
    "wrap_model": "kvlab.api",
    "compress_and_generate": "kvlab.api",
    "Output": "kvlab.api",
    "presets": "kvlab.config.loader",
    "ConfigError": "kvlab.config.errors",
    "Pipeline": "kvlab.pipeline",
    "LoadedModel": "kvlab.models.base",
    "ModelInfo": "kvlab.models.base",
}
_RENAMED = {"presets": "preset_names"}

__all__ = [
    "ConfigError",
    "LoadedModel",
    "ModelInfo",
    "Output",
    "Pipeline",
    "compress_and_generate",
    "compression_config",
    "load_model",
    "load_pipeline",
    "presets",
    "wrap_model",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
