"""VL-Cache (Tu et al. 2024): layer budgets from the sparsity of the post-vision attention, tokens
ranked by the attention the post-vision queries pay them.

The *post-vision* queries are the prompt's text after its last visual token (the question and the
chat template's tail; the whole prompt when there is no image; :func:`~kvlab.compression.hybridkv.
text_queries` ``trailing``). ``docs/methods/vl_cache.md`` has the equations and kvlab's choices.
Shapes: B batch, H query heads, Hkv KV heads, T padded prompt length, m the post-vision rows held,
L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.compression.allocators import LAYER_ALLOCATORS, LayerAllocator, require_every_layer, round_to_total
from kvlab.compression.context import LayerContext, attention_probs
from kvlab.compression.hybridkv import text_queries
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.compression.ops import reduce_groups
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


def post_vision_attention(ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-vision queries' attention: ``(probs [B, H, m, T], rows [B, m], allowed [B, m, T])``.

    ``m`` is the longest post-vision text of the batch (left padding: it is the last ``m``
    positions); ``rows`` marks each sample's own post-vision rows, ``allowed`` the keys each row may
    attend to (valid and causal). Memoised on ``ctx`` (the scorer and the allocator share it).
    """
    if "post_vision_probs" not in ctx._memo:
        T = ctx.seq_len
        rows_full = text_queries(ctx, "trailing", min_text=1)  # [B, T]
        m = int(rows_full.sum(-1).max())
        queries = ctx.last_queries(m, "VL-Cache (the post-vision queries)")
        probs = attention_probs(queries, ctx, first_query=T - m)  # [B, H, m, T]
        rows = rows_full[:, T - m :]
        positions = torch.arange(T, device=ctx.valid.device)
        causal = positions[None, :] <= positions[T - m :, None]  # [m, T]
        ctx._memo["post_vision_probs"] = probs * rows[:, None, :, None]
        ctx._memo["post_vision_rows"] = rows
        ctx._memo["post_vision_allowed"] = ctx.valid[:, None, :] & causal[None] & rows[:, :, None]
    return ctx._memo["post_vision_probs"], ctx._memo["post_vision_rows"], ctx._memo["post_vision_allowed"]


@IMPORTANCE.register("post_vision_attention")
@dataclass
class PostVisionAttentionScorer(ImportanceScorer):
    """VL-Cache's modality-aware token score: the attention the post-vision queries pay each token.

    ``s_t = gqa_h( sum_{i in post-vision} softmax(q_i K^T * scaling)_t )`` (Tu et al. 2024, the
    modality-aware token scoring): the queries of the text after the image are the ones whose
    attention predicts what decoding reads (the question), unlike all-query accumulation (H2O,
    biased to early tokens) or a fixed recent window (SnapKV, which on a VLM prompt may start
    inside the image). Reads every post-vision query (no chunked prefill). Returns ``[B, Hkv, T]``.
    """

    paper: ClassVar[str | None] = papers.VLCACHE

    gqa: str = "mean"
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        probs, _, _ = post_vision_attention(ctx)
        return reduce_groups(probs.sum(2), ctx.num_kv_heads, self.gqa)  # type: ignore[arg-type]


def post_vision_density(ctx: LayerContext, threshold: float) -> torch.Tensor:
    """``[B]`` fp64: the share of the post-vision attention entries (every query head, every
    post-vision row, its valid causal keys) at or above ``threshold`` times their row's maximum:
    ``1 - gamma_l``, the layer's density (VL-Cache's sparsity ``gamma_l`` is the share below)."""
    probs, _, allowed = post_vision_attention(ctx)
    row_max = probs.amax(-1, keepdim=True)  # [B, H, m, 1]
    dense = (probs >= threshold * row_max) & allowed[:, None]
    return dense.double().sum((1, 2, 3)) / (allowed.double().sum((1, 2)) * ctx.num_heads).clamp(min=1)


@dataclass
class DensityObservations:
    """Each observed layer's post-vision density ``[B]`` by layer index, and the budgets once solved."""

    density: dict[int, torch.Tensor] = field(default_factory=dict)
    budgets: dict[int, torch.Tensor] | None = None


@LAYER_ALLOCATORS.register("vl_cache")
@dataclass
class VLCacheLayerAllocator(LayerAllocator):
    """VL-Cache's sparsity-aware layer budgets: denser post-vision attention, more cache.

    Per sample with per-head budget ``c`` (protected ``w`` included) and prompt length ``n``, layer
    ``l``'s density ``d_l = 1 - gamma_l`` (:func:`post_vision_density`, entries at or above
    ``threshold`` times their row's maximum, kvlab's default 1%) shares the model's free tokens::

        c_l = w + F_l ,   F_l = L (c - w) d_l / sum_l' d_l'        (capped at n - w)

    a layer whose share exceeds its candidates keeps all of them and the excess goes to the other
    layers by the same proportion (water-filling), rounded by largest remainder so the layers keep
    exactly ``L c`` (the uniform total) whenever ``L (c - w)`` candidates exist. Needs every layer's
    density before the first layer is compressed: ``schedule: global`` (kvlab observes all
    layers first, so the budgets are shared exactly over the model). Returns the layer's ``[B]``
    budgets (``docs/methods/vl_cache.md``).
    """

    paper: ClassVar[str | None] = papers.VLCACHE

    threshold: float = 0.01

    capabilities: ClassVar[Capabilities] = Capabilities(needs_all_layers=True, observes_layers=True)

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")

    def observe(self, ctx: LayerContext, scores: dict[str, torch.Tensor], mixed: torch.Tensor) -> None:
        seen = ctx.run.owned(self, DensityObservations)
        seen.density[ctx.layer_idx] = post_vision_density(ctx, self.threshold)

    def allocate(self, budget, lengths, protected, ctx):
        seen = ctx.run.owned(self, DensityObservations)
        require_every_layer(seen.density, ctx, "vl_cache", "the post-vision sparsity")
        if seen.budgets is None:
            layers = sorted(seen.density)
            density = torch.stack([seen.density[layer].cpu() for layer in layers])  # [L, B]
            solved = layer_budgets(density, budget.cpu(), lengths.cpu(), protected.cpu())
            seen.budgets = dict(zip(layers, solved, strict=True))
        return seen.budgets[ctx.layer_idx].to(lengths.device)


def layer_budgets(
    density: torch.Tensor, budget: torch.Tensor, lengths: torch.Tensor, protected: torch.Tensor
) -> torch.Tensor:
    """``[L, B]`` long budgets from the layers' densities ``[L, B]``, the per-head budgets ``[B]``,
    prompt lengths ``[B]`` and protected tokens ``[B]`` (see :class:`VLCacheLayerAllocator`); a
    sample whose budget covers its prompt keeps all of it in every layer."""
    L = density.shape[0]
    out = budget[None].repeat(L, 1)
    for b, (c, n, w) in enumerate(zip(budget.tolist(), lengths.tolist(), protected.tolist(), strict=True)):
        if c >= n:
            continue
        total, room = L * (c - w), n - w
        weights = density[:, b].double().cpu().clamp(min=0) + 1e-12  # a layer of zero density still ranks
        free = torch.zeros(L, dtype=torch.float64, device="cpu")  # host-side arithmetic, as the inputs
        open_ = torch.ones(L, dtype=torch.bool, device="cpu")
        left = float(min(total, L * room))
        while left > 1e-9 and bool(open_.any()):  # water-filling: full layers hand their excess on
            share = torch.where(open_, weights, 0.0)
            grant = share / share.sum() * left
            over = open_ & (free + grant >= room)
            if not bool(over.any()):
                free += grant
                break
            left -= float((room - free[over]).sum())
            free[over] = room
            open_ &= ~over
        out[:, b] = w + round_to_total(free, min(total, L * room))
    return out
