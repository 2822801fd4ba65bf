"""Diversity scorers: LayerContext -> ``[B, Hkv, T]`` float32, higher means more distinct from the rest.

Keys are cast to fp32 before every reduction (the anchor means, the norms, the projections).
``capabilities`` (``chunked_prefill``) as for importance scorers
(:mod:`kvlab.compression.importance`): these read keys only, so a chunked prefill supports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlab.compression.context import LayerContext
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry


class DiversityScorer(Component):
    """Base class: override :meth:`score`; declare ``chunked_prefill`` (see the module docstring)."""

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        """Return ``[B, Hkv, T]`` float32 scores, higher means keep."""
        raise NotImplementedError


DIVERSITY: Registry[DiversityScorer] = Registry("diversity scorer", "model.compression.diversity.<role>")


@DIVERSITY.register("keydiff")
@dataclass
class KeyDiffScorer(DiversityScorer):
    """KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction ...", Sec. 3):
    ``s_t = -cos(k_t, a)`` per (sample, KV head); keys pointing away from the anchor ``a`` are the
    distinctive ones and are kept.

    ``anchor`` is a mean over the sample's valid (non-padding) keys, window included:

    - ``unit_mean`` (default, the paper's): ``a = mean_j k_j / ||k_j||``, the mean of the
      unit-normalised keys. KeyDiff obtains it by relaxing "keep the N keys of least pairwise
      cosine similarity" (normalised keys, the kept subset's mean replaced by the mean over all
      keys); kvpress's ``KeyDiffPress`` uses the same anchor.
    - ``raw_mean``: ``a = mean_j k_j``, the mean of the raw keys (kvlab's anchor before it
      followed the paper): a few large-norm keys pull it towards themselves.

    With ``unit_mean`` the ranking per head equals MixKV's ``mean_key_diversity`` (which drops
    the ``||a||`` factor). Shapes: keys ``[B, Hkv, T, D]`` -> scores ``[B, Hkv, T]`` fp32.
    """

    paper: ClassVar[str | None] = papers.KEYDIFF

    anchor: Literal["unit_mean", "raw_mean"] = "unit_mean"
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        keys = ctx.keys_fp32()  # [B, Hkv, T, D]
        if self.anchor == "unit_mean":
            anchor = ctx.unit_key_mean()[:, :, None]  # [B, Hkv, 1, D]
        else:
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

    paper: ClassVar[str | None] = papers.MIXKV

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        projection = (ctx.keys_fp32() @ ctx.unit_key_mean()[..., None]).squeeze(-1)  # k_t . mean
        return -projection / ctx.key_norms()
