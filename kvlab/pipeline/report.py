"""LayerReport: what one layer's compression did (predictions, TensorBoard, protocols)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.routing import RouteDecision


@dataclass
class LayerReport:
    """What one layer's compression did, for predictions and TensorBoard.

    ``kept`` is ``[B, Hkv]`` (tokens kept per head), ``budget`` the layer budget ``[B]``,
    ``selection`` which positions were kept, and ``scores`` the mixed ``[B, Hkv, T]`` score (only
    when the pipeline is asked to record scores). ``scorer_scores`` then also holds each
    scorer's own ``[B, Hkv, T]`` output by role (non-candidate positions -inf) for the per-scorer
    TensorBoard histograms. ``route`` says which branch each sample took when the pipeline routes.
    ``overshoot`` ``[B]`` counts the tokens per head a sample keeps beyond its asked budget:
    because its protected window does not fit (``Budget.overshoot``), or because a component kept
    more than the layer budget (:func:`kvlab.pipeline.execution.overshoot`); None without a budget.
    """

    layer_idx: int
    kept: torch.Tensor
    budget: torch.Tensor
    selection: Selection | None = None
    seconds: float = 0.0
    scores: torch.Tensor | None = None
    route: RouteDecision | None = None
    scorer_scores: dict[str, torch.Tensor] | None = None
    overshoot: torch.Tensor | None = None


def budget_overshoot(reports: Sequence[LayerReport]) -> torch.Tensor | None:
    """Tokens per head each sample kept beyond its asked budget, ``[B]`` (the most over layers),
    or None when no layer reported one (nothing compressed)."""
    values = [r.overshoot for r in reports if getattr(r, "overshoot", None) is not None]
    # each layer's tensor is on its layer's device (several under a device_map)
    return torch.stack([v.cpu() for v in values]).amax(0) if values else None
