"""FastV (Chen et al. 2024): drop R% of the image tokens from layer K on, ranked at layer K - 1.

FastV prunes image tokens from the prompt's forward: after layer K - 1 it ranks the image tokens
by the attention they receive, averaged over the heads, and the ``R`` share with the least is
removed from the hidden states, so layers K, K + 1, ... never see them (Sec. 4 of the paper;
K = 2, R = 50% its headline setting). kvlab compresses the KV cache after each layer's attention
and cannot change the prefill, so its FastV evicts those tokens' keys and values from the caches
of layers K, K + 1, ...: the tokens generated after the prompt never attend to them there, while
the prompt's own forward is the full model's (``docs/methods/fastv.md`` says what this
approximates). Two components, the rest is the modality machinery:

- :class:`FastVLayerAllocator` (``allocate.layer: fastv``): layers below K whole; from K on each
  sample keeps its prompt less ``R`` of its image tokens (never fewer than the budget);
- :class:`FastVAttention` (``importance.attention: fastv_attention``): the ranking, taken once at
  layer K - 1 and kept for every later layer and KV head;
- ``allocate.modality: text_prior`` (``overflow: keep_all_text``): every text token kept, the
  image tokens by the ranking (:mod:`kvlab.compression.modality`).

Shapes: B batch, H query heads, Hkv KV heads, T padded prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import LAYER_ALLOCATORS, LayerAllocator
from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@LAYER_ALLOCATORS.register("fastv")
@dataclass
class FastVLayerAllocator(LayerAllocator):
    """FastV's schedule: layers ``< layer`` (K) keep everything; from K on, ``R`` of the image tokens go.

    Per sample with ``T`` prompt tokens of which ``N_img`` are image (or video) tokens, a layer
    ``l >= K`` keeps ``max(budget, T - N_img + round((1 - R) N_img))`` tokens per head, with
    ``R = drop``: the released code keeps ``round(N_img (1 - R))`` image tokens
    (``topk(round(image_token_length * (1 - R)))``). The budget is a floor: the preset's is 0
    (``ratio: 0.0``), so R alone decides; a budget above FastV's count keeps more (a budget at least
    the prompt keeps everything). A sample without image tokens is not compressed.
    """

    paper: ClassVar[str | None] = papers.FASTV

    layer: int = 2
    drop: float = 0.5

    def __post_init__(self) -> None:
        if self.layer < 1:
            raise ValueError(f"layer must be >= 1 (FastV ranks at layer K - 1), got {self.layer}")
        if not 0.0 <= self.drop <= 1.0:
            raise ValueError(f"drop must be in [0, 1] (the share of image tokens evicted), got {self.drop}")

    def allocate(
        self, budget: torch.Tensor, lengths: torch.Tensor, protected: torch.Tensor, ctx: LayerContext
    ) -> torch.Tensor:
        if ctx.layer_idx < self.layer:
            return lengths.clone()
        images = ((ctx.modality > 0) & ctx.valid).sum(-1)  # [B]
        kept_images = torch.round(images.double() * (1.0 - self.drop)).long()
        return torch.maximum(budget, lengths - images + kept_images)


@dataclass
class FastVRanking:
    """What :class:`FastVAttention` keeps for a run (``ctx.run.owned``): the ranking ``[B, T]`` fp32
    taken at layer K - 1 (or the first layer it scored after it) and the layer it was taken at."""

    scores: torch.Tensor | None = None
    layer: int | None = None


@IMPORTANCE.register("fastv_attention")
@dataclass
class FastVAttention(ImportanceScorer):
    """FastV's ranking: the attention each token receives at layer K - 1, averaged over every query head.

    ``queries: last`` (default, the released code): ``s_t = (1/H) sum_h A^h_{L, t}``, the attention
    the prompt's last query pays token ``t`` (``last_layer_attention_avg[-1]`` after
    ``torch.mean(attention, dim=1)``). ``queries: all`` (the paper's Sec. 4 text): the average
    attention a token receives from every prompt token,
    ``s_t = (1/H) sum_h (1/n) sum_{j} A^h_{j, t}`` (``n`` the sample's tokens). One score for every
    KV head (FastV removes tokens, not per-head entries), ``[B, Hkv, T]`` fp32.

    The ranking is taken at layer ``layer - 1`` (K - 1, the attention map FastV reads before
    pruning at layer K) and returned unchanged for every later layer, so each layer from K on
    evicts the same image tokens, as FastV's pruned tokens are gone from every later layer (if
    layer K - 1 is not scored, e.g. a sliding layer kept whole, the first layer scored after it
    ranks). ``layer`` restates ``allocate.layer.layer`` (the ``fastv`` layer allocator's K).
    Earlier layers get their own attention (they are kept whole).

    Declares ``chunked_prefill=False``: ``queries: all`` reads every prompt query, and the ranking
    belongs to the prefill (a vision-language model is prefilled in one forward anyway; the
    ``decode_time`` protocol, which rescores the cache, refuses it).
    """

    paper: ClassVar[str | None] = papers.FASTV

    layer: int | None = None
    queries: Literal["last", "all"] = "last"

    layer_allocator_settings: ClassVar[dict[str, str]] = {"layer": "layer"}
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)

    def __post_init__(self) -> None:
        if self.layer is not None and self.layer < 1:
            raise ValueError(f"layer must be >= 1 (FastV ranks at layer K - 1), got {self.layer}")

    def score(self, ctx: LayerContext) -> torch.Tensor:
        if self.layer is None:
            raise ValueError("fastv_attention needs `layer` (K): set it, or allocate.layer: {name: fastv}")
        held = ctx.run.owned(self, FastVRanking)
        same_prompt = held.scores is not None and held.scores.shape == ctx.valid.shape
        if same_prompt and held.layer is not None and ctx.layer_idx > held.layer:
            ranking = held.scores
        else:
            ranking = self.received(ctx)
            if ctx.layer_idx >= self.layer - 1 and held.scores is None:
                held.scores, held.layer = ranking, ctx.layer_idx
        return ranking[:, None, :].expand(-1, ctx.num_kv_heads, -1)

    def received(self, ctx: LayerContext) -> torch.Tensor:
        """``[B, T]`` fp32: the attention each token receives at this layer, averaged over the heads
        (and, with ``queries: all``, over the sample's queries); 0 on padding."""
        if self.queries == "last":
            per_head = ctx.window_attention_scores(1)  # [B, H, T]: the last query's row
        else:
            per_head = ctx.cumulative_attention() / ctx.lengths.clamp(min=1)[:, None, None].float()
        return per_head.mean(1).masked_fill(~ctx.valid, 0.0)
