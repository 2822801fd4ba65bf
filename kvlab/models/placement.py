"""Placing a model over several devices with a ``device_map`` (accelerate), as ``from_pretrained`` does.

``device_map`` is ``None`` (the model stays where it was built), one of accelerate's strategies
(``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``) or an explicit mapping of
module names to devices (``{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
..., "lm_head": 1}``; ``""`` names the whole model). Hub and local models pass it to
``from_pretrained``; built-in models are built on the CPU and then dispatched by
:func:`dispatch` (``accelerate.infer_auto_device_map`` for a strategy, ``accelerate.dispatch_model``
with hooks that move each module's inputs to its device). The compressed cache then lives on
each layer's device (``docs/scaling.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import check_device_map, get_balanced_memory

from kvlab.config.errors import ConfigError

#: device_map strategies accelerate (and ``from_pretrained``) understand
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

DeviceMap = str | dict[str, str | int | torch.device]


def validate_device_map(device_map: Any) -> None:
    """Raise :class:`ConfigError` unless ``device_map`` is None, a strategy or a module -> device dict."""
    if device_map is None:
        return
    if isinstance(device_map, str):
        if device_map in STRATEGIES:
            return
    elif isinstance(device_map, dict) and device_map:
        bad = {
            k: v
            for k, v in device_map.items()
            if not isinstance(k, str) or not isinstance(v, str | int | torch.device) or isinstance(v, bool)
        }
        if not bad:
            return
        raise ConfigError(
            f"model.device_map maps module names to devices, but these entries are not `name: device`: "
            f"{bad!r}. Write e.g. {{model.embed_tokens: 0, model.layers.0: 0, model.layers.1: 1, "
            "lm_head: 1} "
            f"(devices as an index, 'cuda:1', 'cpu' or 'disk'), or use one of {', '.join(STRATEGIES)}."
        )
    raise ConfigError(
        f"model.device_map must be one of {', '.join(STRATEGIES)}, a mapping of module names to devices, or "
        f"null (the model stays on one device), got {device_map!r}. `auto` spreads the layers over the "
        "visible accelerators (accelerate); see docs/scaling.md."
    )


def dispatch(model: torch.nn.Module, device_map: DeviceMap, dtype: torch.dtype) -> torch.nn.Module:
    """Spread a built model over devices as ``from_pretrained(device_map=...)`` would.

    A strategy name is resolved with ``accelerate.infer_auto_device_map`` (balanced over the
    accelerators for everything but ``sequential``; decoder layers are never split); the map is
    checked to cover every parameter and applied with ``accelerate.dispatch_model``. Hooks are
    always installed (even when everything lands on one device), so each module receives its
    inputs on its own device and the model returns its outputs on the input device. The
    resolved map is stored as ``model.hf_device_map``.

    Args:
        model: a model built on the CPU (weights loaded).
        device_map: a strategy or a module name -> device mapping (:func:`validate_device_map`).
        dtype: the model's dtype (for the memory estimate of a strategy).

    Returns:
        the same model, dispatched.
    """
    validate_device_map(device_map)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if isinstance(device_map, str):
        max_memory = None
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, dtype=dtype, low_zero=device_map == "balanced_low_0", no_split_module_classes=no_split
            )
        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype
        )
    try:
        check_device_map(model, device_map)
    except ValueError as error:
        raise ConfigError(
            f"model.device_map does not place every weight: {error} Add the missing modules (a parent "
            "name such as `model.layers.3` covers its children; `''` is the whole model) or use "
            f"`device_map: auto`."
        ) from None
    skip = getattr(model, "_skip_keys_device_placement", None)
    model = dispatch_model(model, device_map=dict(device_map), skip_keys=skip, force_hooks=True)
    model.hf_device_map = dict(device_map)
    return model


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs go: its input embeddings' device (the first module a prompt meets).

    With a ``device_map`` this is the device of ``embed_tokens``, not necessarily the first
    parameter's (a VLM's vision tower may come first).
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return next(model.parameters()).device
