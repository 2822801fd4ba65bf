"""CurDKV: an importance scorer from approximate leverage scores of the keys and values.

Sengupta et al. 2025 ("Value-Guided KV Compression for LLMs via Approximated CUR Decomposition",
arXiv 2509.15038), as kvpress 0.5.5's ``CURPress`` computes it, with its defaults.
``docs/methods/cur.md`` derives the score and lists the choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities

Leverage = Literal["key", "value", "kv_avg", "kv_product"]


def local_shares(scores: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Each score over the sum of its local window: ``[B, Hkv, T]`` -> ``[B, Hkv, T]``.

    The windows are ``window`` consecutive tokens of a sample's own positions (``positions [B, T]``,
    -1 on padding, whose scores must be 0): ``[0, w), [w, 2w), ...``, the last one partial (kvpress
    pads it with zeros). A window summing to 0 divides by 1e-30 instead.
    """
    B, Hkv, T = scores.shape
    index = (positions.clamp(min=0) // window)[:, None, :].expand(B, Hkv, T)  # [B, Hkv, T]
    sums = torch.zeros(B, Hkv, -(-T // window), dtype=scores.dtype, device=scores.device)
    sums.scatter_add_(-1, index, scores)
    return scores / sums.gather(-1, index).clamp_min(1e-30)


def gaussian_sketch(dim: int, width: int, seed: int, layer_idx: int) -> torch.Tensor:
    """A right Gaussian sketch ``[dim, width]`` with entries ``N(0, 1 / width)``, drawn on the host
    from ``(seed, layer_idx)``: the same for every batch and head of a layer."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    return torch.randn(dim, width, generator=gen, device="cpu") / math.sqrt(width)


@IMPORTANCE.register("cur")
@dataclass
class CurScorer(ImportanceScorer):
    """CurDKV's leverage scores of the keys (``k2``) and values (``v2``), combined per token.

    Per (sample, KV head), with ``X`` the keys or the values ``[n, D]`` of the sample's valid tokens
    and ``G`` an optional Gaussian sketch ``[D, r]`` with entries ``N(0, 1/r)`` (``projection: r``)::

        x2_t = ||(X G)_t||^2                          (||X_t||^2 without a projection)
        x2_t <- x2_t / sum_{u in window(t)} x2_u      (local_window: w; windows of w positions)
        s_t  = k2_t * v2_t  (kv_product) | (k2_t + v2_t) / 2 (kv_avg) | k2_t (key) | v2_t (value)
        s_t <- s_t / sum_u s_u

    The paper ranks tokens by CUR leverage scores, the squared row norms ``||U_k[t]||^2`` of the
    top-``k`` left singular vectors of ``X``, approximated with a Gaussian random projection. The
    reference code (kvpress) computes neither an SVD nor ``U_k``: it takes the squared row norms of
    ``X`` (or of the sketch ``X G`` with ``use_random_leverage``), CUR's norm-squared sampling
    weights, and by default normalises them within local windows of 16 tokens
    (``use_local_approximation``); kvlab computes what the reference code computes, with its
    defaults (no projection, windows of 16, ``kv_product``). The sketch is drawn from ``(seed,
    layer)`` (kvpress draws it unseeded), the same for every batch; the sinks that kvpress scores
    1.0 are ``budget.sinks``, protected by the budget.

    Reads keys and values only (``chunked_prefill``). Shapes: keys and values ``[B, Hkv, T, D]`` ->
    scores ``[B, Hkv, T]`` fp32, 0 on padding.
    """

    paper: ClassVar[str | None] = papers.CURDKV

    leverage: Leverage = "kv_product"
    projection: int | None = None
    local_window: int | None = 16
    seed: int = 0

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys and values only

    def __post_init__(self) -> None:
        if self.projection is not None and self.projection < 1:
            raise ValueError(f"projection must be >= 1 (or null), got {self.projection}")
        if self.local_window is not None and self.local_window < 1:
            raise ValueError(f"local_window must be >= 1 (or null), got {self.local_window}")

    def sketch(self, dim: int, layer_idx: int) -> torch.Tensor:
        """The Gaussian sketch ``G [dim, projection]`` of layer ``layer_idx`` (:func:`gaussian_sketch`)."""
        return gaussian_sketch(dim, self.projection, self.seed, layer_idx)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        weight = ctx.valid[:, None, :].float()  # [B, 1, T]
        positions = ctx.positions()

        def squared_norms(states: torch.Tensor) -> torch.Tensor:  # [B, Hkv, T, D] -> [B, Hkv, T]
            if self.projection is not None:
                states = states @ self.sketch(states.shape[-1], ctx.layer_idx).to(states.device)
            norms = states.square().sum(-1) * weight
            return norms if self.local_window is None else local_shares(norms, positions, self.local_window)

        k2 = squared_norms(ctx.keys_fp32()) if self.leverage != "value" else None
        v2 = squared_norms(ctx.values.float()) if self.leverage != "key" else None
        if self.leverage == "key":
            scores = k2
        elif self.leverage == "value":
            scores = v2
        elif self.leverage == "kv_avg":
            scores = (k2 + v2) / 2
        else:
            scores = k2 * v2
        return scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)
