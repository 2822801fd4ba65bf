"""The ``model_topk`` layer allocator: one ranking of every (layer, KV head, entry) of the model.

KVzip's default budgets (Kim et al. 2025: non-uniform head budgets; the authors' ``level="pair"``, kvpress'
``KVzipPress(layerwise=False)``) keep the model's best entries whatever their layer: per sample
with a per-head budget ``c`` (protected tokens ``p`` included) and ``L`` layers of ``Hkv`` heads,
the ``L Hkv (c - p)`` candidates of highest score over the whole model are kept. kvlab's budget is
per layer and per KV head, so this allocator gives layer ``l`` the per-head budget
``p + n_l / Hkv``, ``n_l`` the layer's winners of the model-wide ranking, rounded to whole entries
per head by largest remainder (the total stays ``L c``); with ``allocate.head: {name: adakv,
alpha: 0}`` the heads of the layer then share it by their own ranking, so the kept entries are the
model-wide top exactly when every ``n_l`` is a multiple of ``Hkv``, and differ by the rounding
(less than ``Hkv`` entries of a layer) otherwise.

Needs every layer's scores before the first layer is compressed: ``schedule: global`` (the
``reconstruct`` prefill scores every layer before it compresses any). Shapes: B batch, Hkv KV
heads, T padded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.compression.allocators import (
    LAYER_ALLOCATORS,
    LayerAllocator,
    layer_signal,
    require_every_layer,
    round_to_total,
)
from kvlab.compression.context import LayerContext
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@dataclass
class RankedLayers:
    """What ``model_topk`` saw of one batch: each observed layer's candidate scores ``[B, Hkv, T]``
    (-inf off the candidates) by layer index, and the solved budgets ``[B]`` by layer index."""

    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    sizes: dict[int, torch.Tensor] | None = None


@LAYER_ALLOCATORS.register("model_topk")
@dataclass
class ModelTopKAllocator(LayerAllocator):
    """Layer budgets from one model-wide ranking of the candidates by ``signal`` (KVzip's default):
    layer ``l`` gets ``p + round(n_l / Hkv)``, ``n_l`` its entries among the model's best
    ``L Hkv (c - p)`` (ties to the lower layer, head, position). ``signal``: ``mixed`` or a role."""

    paper: ClassVar[str | None] = papers.KVZIP
    capabilities: ClassVar[Capabilities] = Capabilities(needs_all_layers=True, observes_layers=True)

    signal: str = "mixed"

    def observe(self, ctx: LayerContext, scores: dict[str, torch.Tensor], mixed: torch.Tensor) -> None:
        """Keep layer ``ctx.layer_idx``'s candidate scores for the ranking."""
        signal = layer_signal(self.signal, scores, mixed)
        seen = ctx.run.owned(self, RankedLayers)
        seen.scores[ctx.layer_idx] = signal.float().masked_fill(~ctx.candidates[:, None, :], float("-inf"))

    def allocate(self, budget, lengths, protected, ctx):
        seen = ctx.run.owned(self, RankedLayers)
        require_every_layer(seen.scores, ctx, "model_topk", "the entries' scores")
        if seen.sizes is None:
            layers = sorted(seen.scores)
            seen.sizes = dict(zip(layers, self.sizes(seen, budget, lengths, protected, layers), strict=True))
        return seen.sizes[ctx.layer_idx].to(lengths.device)

    def sizes(
        self,
        seen: RankedLayers,
        budget: torch.Tensor,
        lengths: torch.Tensor,
        protected: torch.Tensor,
        layers: list[int],
    ) -> torch.Tensor:
        """``[len(layers), B]`` per-head budgets: ``p + n_l / Hkv`` rounded, summing to ``L c`` per sample."""
        scores = torch.stack([seen.scores[layer] for layer in layers])  # [L, B, Hkv, T]
        L, B, Hkv, T = scores.shape
        out = budget.to(scores.device)[None].repeat(L, 1)
        for b, (c, n, p) in enumerate(
            zip(budget.tolist(), lengths.tolist(), protected.tolist(), strict=True)
        ):
            if c >= n:
                continue
            free = max(0, c - p)
            flat = scores[:, b].reshape(-1)  # (layer, head, position) order
            order = torch.sort(flat, descending=True, stable=True).indices[: L * Hkv * free]
            winners = torch.bincount(order // (Hkv * T), minlength=L).double()  # [L]
            out[:, b] = p + round_to_total(winners / Hkv, L * free).to(out.device)
        return out
