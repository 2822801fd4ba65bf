"""A model's attention shape read from its config alone (no weights): what artefacts are checked against."""

from __future__ import annotations

from kvlab.models import hub
from kvlab.models.builtin import MODELS
from kvlab.models.info import model_info


def model_shape(model: str) -> dict[str, int]:
    """``num_layers`` / ``num_heads`` / ``num_kv_heads`` of a built-in model or of a local directory's
    config, read without weights; empty when unknown (a Hub id is not fetched here)."""
    try:
        if model in MODELS:
            config = MODELS.get(model)().config()
        elif hub.local_dir(model) is not None:
            config = hub.load_config(model)
        else:
            return {}
        info = model_info(config, model)
    except Exception:  # the model itself is reported when it loads; the shape is checked there again
        return {}
    return {"num_layers": info.num_layers, "num_heads": info.num_heads, "num_kv_heads": info.num_kv_heads}
