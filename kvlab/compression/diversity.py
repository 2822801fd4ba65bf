"""Diversity scorers: LayerContext -> ``[B, Hkv, T]`` float32, higher means more distinct from the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.compression.context import LayerContext
from kvlab.config.registry import Registry


class DiversityScorer:
    """Base class: override :meth:`score`."""

    registry_name: str = ""

    def score(self, ctx: LayerContext) -> torch.Tensor:
        """Return ``[B, Hkv, T]`` float32 scores, higher means keep."""
        raise NotImplementedError


DIVERSITY: Registry[DiversityScorer] = Registry("diversity scorer", "model.compression.diversity.<role>")


@DIVERSITY.register("keydiff")
@dataclass
class KeyDiffScorer(DiversityScorer):
    """KeyDiff (Park et al. 2025): ``s_t = -cos(k_t, mean_j k_j)`` per (sample, KV head).

    The anchor is the mean of the sample's valid (non-padding) keys; keys pointing away from it
    are the distinctive ones.
    """

    def score(self, ctx: LayerContext) -> torch.Tensor:
        keys = ctx.keys.float()  # [B, Hkv, T, D]
        weight = ctx.valid[:, None, :, None].float()
        anchor = (keys * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, anchor, dim=-1)


@DIVERSITY.register("mean_key_diversity")
@dataclass
class MeanKeyDiversityScorer(DiversityScorer):
    """MixKV's key diversity (Liu et al. 2025, Sec. 3.2): ``s_t = -k̂_t · mean_j k̂_j``.

    ``k̂ = k / ||k||`` are unit keys of one (sample, KV head); the mean runs over every valid
    token of the sample, the observation window included, and is *not* re-normalised (so
    ``s_t = -||mean k̂|| cos(k_t, mean k̂)``; the per-head factor cancels in MixKV's min-max).
    Differs from ``keydiff`` only in the anchor: the mean of unit keys instead of raw keys.

    Shapes: keys ``[B, Hkv, T, D]`` -> scores ``[B, Hkv, T]`` fp32.
    """

    def score(self, ctx: LayerContext) -> torch.Tensor:
        projection = (ctx.keys_fp32() @ ctx.unit_key_mean()[..., None]).squeeze(-1)  # k_t . mean
        return -projection / ctx.key_norms()
