"""LayerReport: what one layer's compression did (predictions, TensorBoard, protocols)."""

from __future__ import annotations

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
    ``overshoot`` ``[B]`` counts the tokens per head a sample keeps beyond its asked budget
    because its protected window does not fit (``Budget.overshoot``; None without a budget).
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
