"""Compactor's leverage scores: how much each key is an outlier of its head's key geometry.

Chari & Van Durme 2025 ("Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", arXiv 2507.08143), as kvpress 0.5.5's ``LeverageScorePress`` computes it, with
its defaults. ``docs/methods/leverage.md`` derives the score and lists the choices.
Shapes: B batch, Hkv KV heads, T padded prompt length, D head dim, r sketch width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.cur import gaussian_sketch
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("leverage")
@dataclass
class LeverageScorer(ImportanceScorer):
    """Ridge leverage scores of the centred pre-RoPE keys after a right Gaussian sketch, z-scored.

    Per (sample, KV head), with ``K`` the pre-RoPE keys ``[n, D]`` of the sample's valid tokens
    (the model fact ``keys_before_rotation``) and ``G`` a Gaussian sketch ``[D, r]`` with entries
    ``N(0, 1/r)`` (``sketch_dimension: r``; none with ``sketch_dimension: null``)::

        X   = (K - mean_t K_t) G                       [n, r]  (centred over the sample's tokens)
        l_t = X_t (X^T X + ridge I)^{-1} X_t^T  >= 0     the t-th diagonal entry of the hat matrix
        s_t = (l_t - mean l) / max(std l, 1e-6)          over the sample's heads and tokens

    ``l_t`` is the statistical leverage of key ``t`` (the squared row norm of the left singular
    vectors of ``X`` when ``ridge`` is 0): a key far from the span the other keys share scores
    high. The reference code says its solve differs from the paper's: it uses a Cholesky factor
    of ``X^T X`` plus a jitter of 1e-2 (raised tenfold when the factorisation fails), which is
    the ridge here; kvlab follows the reference and solves in fp64, where ``ridge`` 1e-2
    factorises for any realistic key scale (a failure raises: no jitter is raised quietly).
    With ``r >= D`` the sketch has full row rank almost surely, ``X`` spans the keys' column
    space and the leverage does not depend on the sketch (up to the ridge). The z-score is over
    each sample's heads and valid tokens (the reference's is over the whole batch tensor, which
    depends on the batch; it equals this for one sample); it is a positive affine map of each
    sample's scores, so it changes no ranking within or across a sample's heads, only what a
    mixer adds them to.

    The sketch is drawn from ``(seed, layer)`` (kvpress draws one per head, unseeded), one for
    every head and batch. Reads keys only (``chunked_prefill``); refused on a model whose rotary
    embedding cannot be inverted (the model fact's refusals). Shapes: keys ``[B, Hkv, T, D]`` ->
    scores ``[B, Hkv, T]`` fp32, 0 on padding.
    """

    paper: ClassVar[str | None] = papers.COMPACTOR

    sketch_dimension: int | None = 48
    ridge: float = 1e-2
    seed: int = 0

    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=True,  # keys only
        model_facts=("keys_before_rotation",),
    )

    def __post_init__(self) -> None:
        if self.sketch_dimension is not None and self.sketch_dimension < 1:
            raise ValueError(
                f"sketch_dimension must be >= 1 (or null: no sketch), got {self.sketch_dimension}"
            )
        if not self.ridge > 0:
            raise ValueError(
                f"ridge must be > 0 (the reference's 1e-2 keeps X^T X + ridge I invertible), got {self.ridge}"
            )

    def score(self, ctx: LayerContext) -> torch.Tensor:
        weight = ctx.valid[:, None, :, None].float()  # [B, 1, T, 1]
        count = ctx.lengths.clamp(min=1)[:, None, None, None].float()
        keys = ctx.keys_before_rotation() * weight  # [B, Hkv, T, D] fp32, 0 on padding
        centred = (keys - keys.sum(2, keepdim=True) / count) * weight
        if self.sketch_dimension is not None:
            sketch = gaussian_sketch(keys.shape[-1], self.sketch_dimension, self.seed, ctx.layer_idx)
            centred = centred @ sketch.to(centred.device)  # [B, Hkv, T, r]
        x = centred.double()
        gram = x.transpose(-1, -2) @ x
        gram = gram + self.ridge * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        factor, info = torch.linalg.cholesky_ex(gram)
        if bool((info != 0).any()):
            raise RuntimeError(
                f"leverage: X^T X + {self.ridge} I is not positive definite in fp64 at layer {ctx.layer_idx} "
                "(keys too large for the ridge): raise importance.<role>.ridge"
            )
        solved = torch.cholesky_solve(x.transpose(-1, -2), factor)  # (X^T X + ridge I)^{-1} X^T
        leverage = (x * solved.transpose(-1, -2)).sum(-1).clamp_min(0).float()  # [B, Hkv, T]
        return zscore(leverage, ctx.valid)


def zscore(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / max(std, 1e-6)`` of ``scores [B, Hkv, T]`` over each sample's heads and valid
    tokens (``valid [B, T]``; std with Bessel's correction, as ``torch.std``), 0 on padding."""
    mask = valid[:, None, :].expand_as(scores)
    count = mask.sum((1, 2)).clamp(min=1).float()[:, None, None]  # [B, 1, 1]
    mean = (scores * mask).sum((1, 2), keepdim=True) / count
    var = ((scores - mean).square() * mask).sum((1, 2), keepdim=True) / (count - 1).clamp(min=1)
    return ((scores - mean) / var.sqrt().clamp_min(1e-6)) * mask
