"""Per-layer budgets written by hand: the ``per_layer`` layer allocator (kvpress' PerLayerCompressionPress).

kvpress 0.5.5 wraps any scorer press in ``PerLayerCompressionPress(press, compression_ratios)``: layer
``l`` runs the press at its own compression ratio ``compression_ratios[l]``. In kvlab the wrapper
is a layer allocator: ``allocate.layer: {name: per_layer, ratios: [r_0, ..., r_{L-1}]}`` under any
scorers, head allocator and selector. ``docs/methods/per_layer.md`` lists the choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvlab.compression.allocators import LAYER_ALLOCATORS, LayerAllocator
from kvlab.config.errors import ConfigError

WHERE = f"{LAYER_ALLOCATORS.field}.ratios"


@LAYER_ALLOCATORS.register("per_layer")
@dataclass
class PerLayerAllocator(LayerAllocator):
    """Layer ``l`` keeps ``floor(ratios[l] * C)`` tokens per head, ``C`` each sample's configured budget.

    ``ratios`` holds one kept fraction per decoder layer, each in [0, 1]: a share of the budget, so
    ``budget: {ratio: 1.0}`` makes them shares of each prompt, kvpress' ``compression_ratios`` as
    ``r_l = 1 - compression_ratios[l]`` (kvpress keeps ``int(T * (1 - cr_l))``); a token budget
    scales them. The budget's window and sinks are protected in every layer (a layer whose share
    is below them keeps them, the excess recorded as ``budget_overshoot``). The list's length must
    be the model's layer count: checked when the pipeline binds the model (before it loads, from
    its config), and at the first layer otherwise (a model whose config is not read beforehand).
    """

    ratios: list[float]

    def __post_init__(self) -> None:
        bad = [r for r in self.ratios if not 0.0 <= r <= 1.0]
        if not self.ratios or bad:
            raise ValueError(
                f"ratios must hold one kept fraction in [0, 1] per layer, got {self.ratios!r}"
                + (f" ({bad[0]} is out of range)" if bad else " (empty)")
            )

    def bind_model(self, model: str, shape: Mapping[str, int] | None = None) -> None:
        if shape and "num_layers" in shape:
            self._check_layers(shape["num_layers"], model)

    def _check_layers(self, num_layers: int, model: str) -> None:
        if len(self.ratios) != num_layers:
            raise ConfigError(
                f"{WHERE} holds {len(self.ratios)} ratios, but {model} has {num_layers} decoder layers: "
                f"give one kept fraction per layer ({num_layers} values), or use a layer allocator that "
                "spreads the budget by itself (uniform, pyramid)."
            )

    def allocate(self, budget, lengths, protected, ctx):
        self._check_layers(ctx.num_layers, "the model")
        share = torch.tensor(self.ratios[ctx.layer_idx], dtype=torch.float64)
        return torch.floor(budget.double() * share).to(budget.dtype)
