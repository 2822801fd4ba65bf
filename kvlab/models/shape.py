"""A model's config and attention shape read without weights: what artefacts and model facts are
checked against before the model loads."""

from __future__ import annotations

from typing import Any

from kvlab.models import hub
from kvlab.models.builtin import MODELS
from kvlab.models.info import model_info


def model_config(model: str) -> Any | None:
    """The HF config of a built-in model or of a local directory, read without weights; None when
    unknown (a Hub id is not fetched here) or unreadable (the model is reported when it loads)."""
    try:
        if model in MODELS:
            return MODELS.get(model)().config()
        if hub.local_dir(model) is not None:
            return hub.load_config(model)
    except Exception:  # the model itself is reported when it loads; what needs the config is checked again
        return None
    return None


def model_shape(model: str) -> dict[str, int]:
    """``num_layers`` / ``num_heads`` / ``num_kv_heads`` / ``sliding_layers`` (how many layers attend
    within a sliding window) of a built-in model or of a local directory's config, read without
    weights; empty when unknown (a Hub id is not fetched here)."""
    config = model_config(model)
    if config is None:
        return {}
    try:
        info = model_info(config, model)
    except Exception:  # the model itself is reported when it loads; the shape is checked there again
        return {}
    text = getattr(config, "text_config", None) or config
    layer_types = getattr(text, "layer_types", None) or []
    windowed = getattr(text, "sliding_window", None) is not None
    sliding = sum(t == "sliding_attention" for t in layer_types) if windowed else 0
    return {
        "num_layers": info.num_layers,
        "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads,
        "sliding_layers": sliding,
    }
