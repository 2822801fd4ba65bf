"""ChunkKV: a selector keeping fixed-size chunks of consecutive tokens, ranked by their summed scores.

Liu et al. 2025 ("ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", arXiv 2502.00299: Algorithm 1, chunk-based selection, and the layer-wise index
reuse), composed with any scorer; checked against kvpress 0.5.5's ``ChunkKVPress``.
``docs/methods/chunkkv.md`` lists the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.selectors import SELECTORS, Selector, topk_indices
from kvlab.config import papers


@dataclass
class ReusedScores:
    """What a ``chunkkv`` selector keeps in the run state (``ctx.run.owned``): the scores ``[B, Hkv,
    T]`` its last selecting layer ranked, by that layer's index, for the layers that reuse them."""

    layer: int = -1
    scores: torch.Tensor | None = None


def chunk_index(positions: torch.Tensor, chunk: int, heads: int) -> tuple[torch.Tensor, int]:
    """Each token's chunk ``[B, heads, T]`` long and the number of chunks ``ceil(T / chunk)``.

    Args:
        positions: ``[B, T]`` each token's position in its sample (-1 on padding, put in chunk 0,
            which a caller never counts as a candidate): chunk ``j`` is positions ``[j * chunk,
            (j + 1) * chunk)``.
    """
    B, T = positions.shape
    return (positions.clamp(min=0) // chunk)[:, None, :].expand(B, heads, T), -(-T // chunk)


def chunk_totals(
    scores: torch.Tensor, candidate: torch.Tensor, index: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's summed candidate scores ``[B, Hkv, chunks]`` fp64 and its number of
    candidates ``[B, Hkv, chunks]`` long (``candidate``, ``index``: ``[B, Hkv, T]``)."""
    B, Hkv, _ = scores.shape
    sums = torch.zeros(B, Hkv, chunks, dtype=torch.float64, device=scores.device)
    sums.scatter_add_(-1, index, scores.double().masked_fill(~candidate, 0.0))
    cost = torch.zeros(B, Hkv, chunks, dtype=torch.long, device=scores.device)
    cost.scatter_add_(-1, index, candidate.long())
    return sums, cost


def fill_best(scores: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``keep`` ``[B, Hkv, T]`` bool topped up to ``counts`` ``[B, Hkv]`` with the best-scoring
    candidates (finite ``scores``) it does not hold (ties: the earlier token)."""
    T = scores.shape[-1]
    rest = scores.masked_fill(keep | ~torch.isfinite(scores), float("-inf"))
    remainder = (counts - keep.sum(-1)).clamp(min=0)
    rank = torch.sort(rest, dim=-1, descending=True, stable=True).indices
    chosen = torch.arange(T, device=scores.device) < remainder[..., None]
    return keep | (torch.zeros_like(keep).scatter(-1, rank, chosen) & torch.isfinite(rest))


def chunk_keep(
    scores: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor, chunk: int, shared: bool
) -> torch.Tensor:
    """The kept tokens ``[B, Hkv, T]`` bool of ChunkKV's selection (see :class:`ChunkKVSelector`).

    Args:
        scores: ``[B, Hkv, T]``: +inf on tokens always kept (protected), -inf on tokens never kept
            (padding, not candidates), finite on the candidates.
        counts: ``[B, Hkv]`` long, tokens to keep (the +inf ones included).
        positions: ``[B, T]`` each token's position in its sample (-1 on padding): chunk ``j`` is
            positions ``[j * chunk, (j + 1) * chunk)``.
        chunk: tokens per chunk.
        shared: rank the chunks by their sum over the KV heads (every head keeps the same chunks).
    """
    B, Hkv, T = scores.shape
    protected = scores == float("inf")
    candidate = torch.isfinite(scores)
    free = counts - protected.sum(-1)  # [B, Hkv]
    index, chunks = chunk_index(positions, chunk, Hkv)
    sums, cost = chunk_totals(scores, candidate, index, chunks)
    if shared:
        sums = sums.sum(1, keepdim=True).expand(B, Hkv, chunks)
    sums = sums.masked_fill(cost == 0, float("-inf"))
    order = torch.sort(sums, dim=-1, descending=True, stable=True).indices  # ties: the earlier chunk
    ranked_cost = cost.gather(-1, order)
    fits = (ranked_cost.cumsum(-1) <= free[..., None]) & (ranked_cost > 0)
    fits = fits.long().cumprod(-1).bool()  # whole chunks in rank order, up to the first that does not fit
    kept_chunks = torch.zeros_like(fits).scatter(-1, order, fits)
    keep = protected | (candidate & kept_chunks.gather(-1, index))
    # the remainder of the budget: the best candidates outside the kept chunks
    return fill_best(scores, keep, counts)


@SELECTORS.register("chunkkv")
@dataclass
class ChunkKVSelector(Selector):
    """ChunkKV: keep whole chunks of ``chunk`` consecutive tokens, the best-scoring chunks first.

    Each sample's prompt is cut into chunks of ``chunk`` tokens of its own positions (``[0, c), [c,
    2c), ...``: padding never shifts them). Per (sample, KV head), a chunk's score is the sum of its
    candidates' scores (Algorithm 1: ``A_i = sum_{j in chunk i} A_j``; the protected tokens are kept
    anyway and count for nothing), and its cost its number of candidates. Chunks are kept whole in
    descending score (ties: the earlier chunk) while they fit the head's count minus the protected
    tokens; the remainder, smaller than the first chunk that did not fit, goes to the best-scoring
    candidates outside the kept chunks, so every head keeps exactly its count (the paper and
    kvpress keep whole chunks only, kvpress ``int(chunks * (1 - ratio))`` of them: neither exact).

    ``heads: each`` ranks the chunks of every KV head (Algorithm 1, per head); ``shared`` sums the
    chunk scores over the layer's KV heads so that every head keeps the same chunks (kvpress'
    ``ChunkKVPress``, which also takes the first sample's chunks for the whole batch: kvlab ranks
    each sample's own).

    ``reuse_layers: N`` (the paper's layer-wise index reuse): layer ``l`` with ``l % (N + 1) == 0``
    selects, and the next ``N`` layers select from its scores, so they keep the same positions when
    their counts are the same. The pipeline still scores those layers (the paper skips their
    scoring: the saving is not reproduced, the selections are).

    Shapes: scores ``[B, Hkv, T]`` (+inf protected, -inf padding), counts ``[B, Hkv]`` -> a
    :class:`~kvlab.cache.selection.Selection` of ``counts`` positions per head.
    """

    paper: ClassVar[str | None] = papers.CHUNKKV

    chunk: int = 10
    heads: Literal["each", "shared"] = "each"
    reuse_layers: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.reuse_layers < 0:
            raise ValueError(f"reuse_layers must be >= 0, got {self.reuse_layers}")

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        ranked = self.ranked_scores(scores, counts, ctx)
        keep = self.keep(ranked, counts, ctx.positions())
        return Selection(
            indices=topk_indices(keep.float().masked_fill(~keep, float("-inf")), counts), counts=counts
        )

    def keep(self, scores: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The kept tokens ``[B, Hkv, T]`` bool of ``scores`` (as :meth:`select`'s, possibly another
        layer's under ``reuse_layers``) and ``counts``; ``positions`` ``[B, T]`` (-1 on padding)."""
        return chunk_keep(scores, counts, positions, self.chunk, self.heads == "shared")

    def ranked_scores(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """The scores layer ``ctx.layer_idx`` ranks: its own, or under ``reuse_layers`` those of the
        group's first layer on this layer's candidates (its own +inf and -inf stay). A layer that
        keeps every token (``counts`` >= its candidates and protected tokens: a sliding-window layer
        kept whole) records nothing, and a layer whose group's first layer recorded nothing ranks
        its own scores."""
        if self.reuse_layers == 0:
            return scores
        held = ctx.run.owned(self, ReusedScores)
        source = ctx.layer_idx - ctx.layer_idx % (self.reuse_layers + 1)
        reusable = held.scores is not None and held.scores.shape == scores.shape
        if source != ctx.layer_idx and held.layer == source and reusable:
            return torch.where(torch.isfinite(scores), held.scores, scores)
        if bool((counts < (scores > float("-inf")).sum(-1)).any()):  # a layer kept whole ranks nothing
            held.layer, held.scores = ctx.layer_idx, scores
        return scores
