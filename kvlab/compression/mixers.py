"""Mixers: combine the importance and diversity scores of a layer into one ``[B, Hkv, T]`` score.

Scorers are keyed by the role they play (``importance: {attention: {...}, value_norm: {}}``);
a mixer receives the scores by role and names the roles it gives a part to (MixKV's
``extrinsic: attention``), so nothing depends on the order scorers are written in. Every
mixer checks at config time that the roles it names exist and that every scorer has a part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.config import papers
from kvlab.config.artefacts import UsesArtefact
from kvlab.config.capabilities import Component
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.registry import Registry


class Mixer(Component):
    """Base class: override :meth:`mix` and :meth:`check_roles`."""

    def mix(self, scores: Mapping[str, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        """``scores`` maps each scorer's role to its ``[B, Hkv, T]`` score (importance roles first,
        then diversity, in YAML order); return ``[B, Hkv, T]`` (higher means keep)."""
        raise NotImplementedError

    def check_roles(self, importance: Sequence[str], diversity: Sequence[str], where: str) -> None:
        """Raise :class:`ConfigError` (at config time) unless the roles this mixer names exist among
        the ``importance`` and ``diversity`` roles and every scorer has a part in the mix."""


MIXERS: Registry[Mixer] = Registry("mixer", "model.compression.mixer")


def _unknown_roles(names: Sequence[str], roles: Sequence[str], field_path: str, kind: str) -> None:
    """ConfigError naming ``field_path`` if any of ``names`` is not one of ``roles``."""
    for name in names:
        if name not in roles:
            raise ConfigError(
                f"{field_path} names '{name}', which is not one of the {kind} roles "
                f"({', '.join(roles) or 'none configured'}).{did_you_mean(name, roles)} Name a key of "
                f"model.compression.{kind}, or add a scorer under that key."
            )


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
    """MixKV's scale matching (Sec. 3.3 of the paper): min-max normalise, then rescale to a reference mean.

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
    """``s = sum_r w_r * s_r`` over every scorer's role r (importance then diversity, YAML order).

    ``weights`` maps roles to weights; empty means 1 for every scorer, otherwise it names every
    role. ``normalize`` puts scores of different scales on one footing first, per (sample,
    head) over the candidate tokens (valid, not protected):

    - ``minmax``: each score to [0, 1];
    - ``scale_to_reference``: the ``reference`` role's score as it is, every other one min-max
      normalised and rescaled to the reference's mean. With ``importance: {attention:
      {name: window_attention}, value_norm: {}}`` and ``reference: attention`` this is MixKV's
      integrated importance ``s_ex + s_in_scaled`` (its "+VNorm" ablation).

    A single score with the default settings passes through unchanged. The released MixKV
    code's fixed ``1/3, 1/3, 1/3`` mix of attention, VNorm and diversity (not in the paper) is
    ``weights: {attention: 0.333, value_norm: 0.333, mean_key_diversity: 0.333}, normalize:
    scale_to_reference, reference: attention``.
    """

    weights: dict[str, float] = field(default_factory=dict)
    normalize: Literal["none", "minmax", "scale_to_reference"] = "none"
    reference: str | None = None

    def check_roles(self, importance: Sequence[str], diversity: Sequence[str], where: str) -> None:
        roles = [*importance, *diversity]
        _unknown_roles(list(self.weights), roles, f"{where}.weights", "importance or diversity")
        for role, weight in self.weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ConfigError(f"{where}.weights.{role} must be a number, got {weight!r}.")
        missing = [role for role in roles if role not in self.weights]
        if self.weights and missing:
            raise ConfigError(
                f"{where}.weights gives no weight to {', '.join(missing)}: name every scorer's role "
                "(or leave weights out for 1 each)."
            )
        if (self.normalize == "scale_to_reference") != (self.reference is not None):
            raise ConfigError(
                f"{where}: `normalize: scale_to_reference` and `reference: <role>` go together (the "
                f"role whose scale the others take); got normalize={self.normalize}, "
                f"reference={self.reference}."
            )
        if self.reference is not None:
            _unknown_roles([self.reference], roles, f"{where}.reference", "importance or diversity")

    def mix(self, scores: Mapping[str, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        roles = list(scores)
        weights = [float(self.weights.get(role, 1.0)) for role in roles]
        if len(roles) == 1 and weights[0] == 1.0 and self.normalize == "none":
            return scores[roles[0]]
        mask = ctx.candidates
        total = torch.zeros_like(scores[roles[0]])
        for role, weight in zip(roles, weights, strict=True):
            part = scores[role]
            if self.normalize == "minmax":
                part = minmax(part, mask)
            elif self.normalize == "scale_to_reference" and role != self.reference:
                part, _ = minmax_scaled(part, masked_mean(scores[self.reference], mask), mask)
            total = total + weight * part
        return total


@MIXERS.register("product")
@dataclass
class ProductMixer(Mixer):
    """``s = prod_r (s_r + offset_r)`` over every scorer's role r (importance then diversity).

    ``offsets`` maps roles to the constant added to their score before the product (0 for a role
    it does not name). A score weighted by a norm is this mix: CriticalKV's second stage
    ``(a_t + epsilon) ||W_o v_t||_1`` is ``offsets: {attention: epsilon}`` over an ``attention``
    and a ``projected_value_norm`` role (``docs/methods/criticalkv.md``). A single score with no
    offset passes through unchanged.
    """

    offsets: dict[str, float] = field(default_factory=dict)

    def check_roles(self, importance: Sequence[str], diversity: Sequence[str], where: str) -> None:
        _unknown_roles(
            list(self.offsets), [*importance, *diversity], f"{where}.offsets", "importance or diversity"
        )
        for role, offset in self.offsets.items():
            if isinstance(offset, bool) or not isinstance(offset, int | float):
                raise ConfigError(f"{where}.offsets.{role} must be a number, got {offset!r}.")

    def mix(self, scores: Mapping[str, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        total: torch.Tensor | None = None
        for role, score in scores.items():
            part = score.float() + float(self.offsets.get(role, 0.0))
            total = part if total is None else total * part
        assert total is not None, "a pipeline with a mixer has at least one scorer"
        return total


def head_redundancy(ctx: LayerContext) -> torch.Tensor:
    """MixKV's per-head key redundancy r̄ (Eq. 4 of the paper), ``[B, Hkv]`` fp32 in [0, 1].

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

    Roles (Sec. 3.2 and 3.3 of the paper): ``extrinsic`` names the extrinsic importance
    ``s_ex`` (SnapKV's window attention in the paper); the ``intrinsic`` roles (VNorm:
    ``value_norm``) are min-max normalised, rescaled to ``mean(s_ex)`` and added: ``s_imp =
    s_ex + s_in_scaled``. The ``diversity`` roles (``mean_key_diversity``) are summed, min-max
    normalised and rescaled to the mean of ``s_ex`` (``diversity_scale: ex``, the released
    code, kvlab's default) or of ``s_imp`` (``imp``, the paper's text; see
    ``docs/methods/mixkv.md``). Every min/max/mean runs over the candidate tokens (valid, not
    in the protected window).

    ``redundancy`` chooses r̄ ``[B, Hkv]``: ``online`` (per sample from the keys, Eq. 4, the
    paper's default), ``offline`` (a ``redundancy`` calibration artefact ``[L, Hkv]``, the
    paper's ``W^head†`` ablation), or ``fixed`` (``fixed_redundancy`` for every head: 0 keeps
    the importance ranking, i.e. the host method when there is no intrinsic term; 0.5 is the
    uniform-mix ablation ``s_imp + s_div_scaled`` up to scale; 1 is diversity only).
    Non-candidate positions are -inf in the output (the pipeline protects the window itself).

    Shapes: every score ``[B, Hkv, T]`` -> ``[B, Hkv, T]`` fp32.
    """

    paper: ClassVar[str | None] = papers.MIXKV

    extrinsic: str
    diversity: tuple[str, ...]
    intrinsic: tuple[str, ...] = ()
    redundancy: Literal["online", "offline", "fixed"] = "online"
    fixed_redundancy: float = 0.5
    diversity_scale: Literal["ex", "imp"] = "ex"
    artefact: str = "auto"
    eps: float = 1e-8

    artefact_kind = "redundancy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fixed_redundancy <= 1.0:
            raise ValueError(f"fixed_redundancy must be in [0, 1], got {self.fixed_redundancy}")

    def check_roles(self, importance: Sequence[str], diversity: Sequence[str], where: str) -> None:
        _unknown_roles([self.extrinsic], importance, f"{where}.extrinsic", "importance")
        _unknown_roles(self.intrinsic, importance, f"{where}.intrinsic", "importance")
        _unknown_roles(self.diversity, diversity, f"{where}.diversity", "diversity")
        if not self.diversity:
            raise ConfigError(
                f"{where}.diversity is empty: MixKV mixes in at least one diversity scorer (e.g. "
                "`diversity: {mean_key_diversity: {}}` and `mixer: {..., diversity: [mean_key_diversity]}`)."
            )
        named = [self.extrinsic, *self.intrinsic, *self.diversity]
        twice = sorted({role for role in named if named.count(role) > 1})
        unused = [role for role in [*importance, *diversity] if role not in named]
        if twice or unused:
            raise ConfigError(
                f"{where}: every scorer plays exactly one MixKV role (extrinsic, intrinsic or "
                f"diversity); {'named twice: ' + ', '.join(twice) if twice else ''}"
                f"{'; ' if twice and unused else ''}{'no role for: ' + ', '.join(unused) if unused else ''}. "
                "List each under the mixer's extrinsic, intrinsic or diversity, or remove the scorer."
            )

    def bind_model(self, model: str, shape: Mapping[str, int] | None = None) -> None:
        if self.redundancy == "offline":
            super().bind_model(model, shape)

    def redundancy_of(self, ctx: LayerContext) -> torch.Tensor:
        """r̄ ``[B, Hkv]`` for this layer, as configured."""
        if self.redundancy == "online":
            return head_redundancy(ctx)
        if self.redundancy == "offline":
            table = self.artefact_for(ctx).tensors["redundancy"].float()  # [L, Hkv]
            return table[ctx.layer_idx].to(ctx.keys.device).expand(ctx.batch_size, -1)
        return torch.full((ctx.batch_size, ctx.num_kv_heads), self.fixed_redundancy, device=ctx.keys.device)

    def mix(self, scores: Mapping[str, torch.Tensor], ctx: LayerContext) -> torch.Tensor:
        mask = ctx.candidates
        s_ex = scores[self.extrinsic].float()
        s_imp = s_ex
        mean_ex = mean_imp = masked_mean(s_ex, mask)
        for role in self.intrinsic:
            scaled, mean_scaled = minmax_scaled(scores[role].float(), mean_ex, mask, self.eps)
            s_imp, mean_imp = s_imp + scaled, mean_imp + mean_scaled
        reference = mean_ex if self.diversity_scale == "ex" else mean_imp
        s_div, _ = minmax_scaled(
            sum(scores[role].float() for role in self.diversity), reference, mask, self.eps
        )
        r = self.redundancy_of(ctx)[..., None]  # [B, Hkv, 1]
        mixed = (1.0 - r) * s_imp + r * s_div
        return mixed.masked_fill(~mask[:, None, :], float("-inf"))
