"""Mixers: combine the importance and diversity scores of a layer into one ``[B, Hkv, T]`` score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.calibration.artefact import UsesArtefact
from kvlab.compression.context import LayerContext
from kvlab.config.errors import ConfigError
from kvlab.config.registry import Registry


class Mixer:
    """Base class: override :meth:`mix`."""

    registry_name: str = ""

    def mix(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], ctx: LayerContext
    ) -> torch.Tensor:
        """Each input is ``[B, Hkv, T]``; return ``[B, Hkv, T]`` (higher means keep)."""
        raise NotImplementedError

    def check_inputs(self, num_importance: int, num_diversity: int, where: str) -> None:
        """Raise :class:`ConfigError` (at config time) if this mixer cannot take these scorer counts."""


MIXERS: Registry[Mixer] = Registry("mixer", "model.compression.mixer")


def _finite_stats(
    scores: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(finite [B, Hkv, T], min, max, mean [B, Hkv, 1])`` over the finite ``mask`` ``[B, T]`` positions."""
    finite = torch.isfinite(scores) & mask[:, None, :]
    lo = scores.masked_fill(~finite, float("inf")).amin(-1, keepdim=True)
    hi = scores.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
    mean = scores.masked_fill(~finite, 0.0).sum(-1, keepdim=True) / finite.sum(-1, keepdim=True).clamp(min=1)
    return finite, lo, hi, mean


def minmax(scores: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Min-max normalise ``[B, Hkv, T]`` scores per (sample, head) over finite ``mask`` ``[B, T]`` positions.

    ``(s - min) / (max - min + eps)``; entries outside the mask or non-finite (e.g. +inf on a
    protected window) are left as they are.
    """
    finite, lo, hi, _ = _finite_stats(scores, mask)
    return torch.where(finite, (scores - lo) / (hi - lo + eps), scores)


def masked_mean(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``[B, Hkv, T]`` scores per (sample, head) over finite positions of ``mask`` ``[B, T]``.

    Returns ``[B, Hkv, 1]`` (0 where the mask is empty).
    """
    return _finite_stats(scores, mask)[3]


def minmax_scaled(
    scores: torch.Tensor, reference_mean: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """MixKV's scale matching (spec Sec. 2.2, 2.6): min-max normalise, then rescale to a reference mean.

    ``minmax(s) * ref_mean / (mean(minmax(s)) + eps)`` per (sample, head), statistics over the
    finite ``mask`` positions; returns ``(scaled [B, Hkv, T], its mean [B, Hkv, 1])``. One pass
    of statistics: the mean of the normalised score is ``(mean - min) / (max - min + eps)``.
    Non-finite or unmasked entries are scaled but not normalised.
    """
    finite, lo, hi, mean = _finite_stats(scores, mask)
    span = hi - lo + eps
    normalised_mean = (mean - lo) / span
    factor = reference_mean / (normalised_mean + eps)
    return torch.where(finite, (scores - lo) / span, scores) * factor, normalised_mean * factor


@MIXERS.register("weighted_sum")
@dataclass
class WeightedSumMixer(Mixer):
    """``s = sum_i w_i * s_i`` over importance then diversity scores (in YAML order).

    ``weights`` defaults to 1 for every score. ``normalize`` puts scores of different scales on
    one footing first, per (sample, head) over the candidate tokens (valid, not protected):

    - ``minmax``: each score to [0, 1];
    - ``scale_to_first``: the first score as it is, every other one min-max normalised and
      rescaled to the first one's mean. With ``importance: [window_attention, value_norm]`` this
      is MixKV's integrated importance ``s_ex + s_in_scaled`` (its "+VNorm" ablation).

    A single score with the default settings passes through unchanged. The released MixKV
    code's fixed ``1/3, 1/3, 1/3`` mix of attention, VNorm and diversity (not in the paper) is
    ``weights: [0.333, 0.333, 0.333], normalize: scale_to_first``.
    """

    weights: tuple[float, ...] = ()
    normalize: Literal["none", "minmax", "scale_to_first"] = "none"

    def check_inputs(self, num_importance: int, num_diversity: int, where: str) -> None:
        count = num_importance + num_diversity
        if self.weights and len(self.weights) != count:
            raise ConfigError(
                f"{where}.weights has {len(self.weights)} entries for {count} scores ({num_importance} "
                f"importance + {num_diversity} diversity); give one weight per scorer, in YAML order."
            )

    def mix(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], ctx: LayerContext
    ) -> torch.Tensor:
        scores = importance + diversity
        weights = self.weights or (1.0,) * len(scores)
        if len(weights) != len(scores):
            raise ValueError(
                f"mixer 'weighted_sum' has {len(weights)} weights for {len(scores)} scores; "
                "give one weight per importance and diversity scorer"
            )
        if len(scores) == 1 and weights[0] == 1.0 and self.normalize == "none":
            return scores[0]
        mask = ctx.candidates
        total = torch.zeros_like(scores[0])
        for i, (weight, score) in enumerate(zip(weights, scores, strict=True)):
            part = score
            if self.normalize == "minmax":
                part = minmax(score, mask)
            elif self.normalize == "scale_to_first" and i > 0:
                part, _ = minmax_scaled(score, masked_mean(scores[0], mask), mask)
            total = total + weight * part
        return total


def head_redundancy(ctx: LayerContext) -> torch.Tensor:
    """MixKV's per-head key redundancy r̄ (spec Eq. 4), ``[B, Hkv]`` fp32 in [0, 1].

    The mean off-diagonal cosine similarity of a head's keys, in O(T D) from the mean unit key
    ``m``: ``r̄ = (T ||m||^2 - 1) / (T - 1)`` with T the sample's valid tokens (window included,
    padding excluded); clamped to [0, 1] (it can dip to -1/(T-1)). 1 for T <= 1.
    """
    T = ctx.lengths.float()[:, None]  # [B, 1]
    norm2 = ctx.unit_key_mean().pow(2).sum(-1)  # [B, Hkv]
    r = (T * norm2 - 1.0) / (T - 1.0).clamp(min=1.0)
    return torch.where(T > 1, r, torch.ones_like(r)).clamp(0.0, 1.0)


@MIXERS.register("mixkv")
@dataclass
class MixKVMixer(Mixer, UsesArtefact):
    """MixKV (Liu et al. 2025): ``s = (1 - r̄) s_imp + r̄ s_div_scaled`` per (sample, KV head).

    Inputs (spec Sec. 2): ``importance[0]`` is the extrinsic importance ``s_ex`` (SnapKV window
    attention); further importance scores (VNorm: ``value_norm``) are min-max normalised and
    rescaled to ``mean(s_ex)`` and added: ``s_imp = s_ex + s_in_scaled``. Diversity scores
    (``mean_key_diversity``) are summed, min-max normalised and rescaled to the mean of
    ``s_ex`` (``diversity_scale: ex``, the released code, default per spec A1) or of ``s_imp``
    (``imp``, the paper). Every min/max/mean runs over the candidate tokens (valid, not in the
    window; spec A3, A14).

    ``redundancy`` chooses r̄ ``[B, Hkv]``: ``online`` (per sample from the keys, Eq. 4, the
    paper's default), ``offline`` (a ``redundancy`` calibration artefact ``[L, Hkv]``, the
    paper's ``W^head†`` ablation), or ``fixed`` (``fixed_redundancy`` for every head: 0 keeps
    the importance ranking, i.e. the host method when there is no intrinsic term; 0.5 is the
    uniform-mix ablation ``s_imp + s_div_scaled`` up to scale; 1 is diversity only).
    Non-candidate positions are -inf in the output (the pipeline protects the window itself).

    Shapes: every score ``[B, Hkv, T]`` -> ``[B, Hkv, T]`` fp32.
    """

    redundancy: Literal["online", "offline", "fixed"] = "online"
    fixed_redundancy: float = 0.5
    diversity_scale: Literal["ex", "imp"] = "ex"
    artefact: str = "auto"
    eps: float = 1e-8

    artefact_kind = "redundancy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fixed_redundancy <= 1.0:
            raise ValueError(f"fixed_redundancy must be in [0, 1], got {self.fixed_redundancy}")

    def check_inputs(self, num_importance: int, num_diversity: int, where: str) -> None:
        if num_importance < 1 or num_diversity < 1:
            raise ConfigError(
                f"{where} 'mixkv' needs importance scorers (the first is the window attention s_ex, "
                "e.g. [window_attention, value_norm]) and at least one diversity scorer (e.g. "
                f"[mean_key_diversity]); got {num_importance} importance and {num_diversity} diversity."
            )

    def bind_model(self, model: str) -> None:
        if self.redundancy == "offline":
            super().bind_model(model)

    def redundancy_of(self, ctx: LayerContext) -> torch.Tensor:
        """r̄ ``[B, Hkv]`` for this layer, as configured."""
        if self.redundancy == "online":
            return head_redundancy(ctx)
        if self.redundancy == "offline":
            table = self.artefact_for(ctx).tensors["redundancy"].float()  # [L, Hkv]
            return table[ctx.layer_idx].to(ctx.keys.device).expand(ctx.batch_size, -1)
        return torch.full((ctx.batch_size, ctx.num_kv_heads), self.fixed_redundancy, device=ctx.keys.device)

    def mix(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], ctx: LayerContext
    ) -> torch.Tensor:
        if not importance or not diversity:
            raise ValueError("mixer 'mixkv' needs at least one importance and one diversity scorer")
        mask = ctx.candidates
        s_ex = importance[0].float()
        s_imp = s_ex
        mean_ex = mean_imp = masked_mean(s_ex, mask)
        for extra in importance[1:]:
            scaled, mean_scaled = minmax_scaled(extra.float(), mean_ex, mask, self.eps)
            s_imp, mean_imp = s_imp + scaled, mean_imp + mean_scaled
        reference = mean_ex if self.diversity_scale == "ex" else mean_imp
        s_div, _ = minmax_scaled(sum(d.float() for d in diversity), reference, mask, self.eps)
        r = self.redundancy_of(ctx)[..., None]  # [B, Hkv, 1]
        mixed = (1.0 - r) * s_imp + r * s_div
        return mixed.masked_fill(~mask[:, None, :], float("-inf"))
