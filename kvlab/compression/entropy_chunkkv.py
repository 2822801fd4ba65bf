"""EntropyGatedChunkKV: ChunkKV whose important but spiky chunks keep only their best tokens.

kvpress 0.5.5's ``EntropyGatedChunkKVPress`` (no paper of its own; it extends ChunkKV, Liu et al.
2025, arXiv 2502.00299, Algorithm 1): the chunks are ranked by their mean score, and a chunk both
important (mean at least the median chunk's) and spiky (the normalised entropy of its scores below
the median chunk's) keeps only its ``low_entropy_chunk`` best tokens, so the budget it frees goes to
further chunks. ``docs/methods/entropy_gated_chunkkv.md`` lists the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.chunkkv import ChunkKVSelector, chunk_index, chunk_totals, fill_best
from kvlab.compression.selectors import SELECTORS

#: kvpress's ``EPSILON``: in the entropy's normaliser and inside its logarithm
EPSILON = 1e-8


def lower_median(values: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """The lower median ``[B, Hkv, 1]`` of each row's ``present`` entries of ``values`` ``[B, Hkv,
    C]`` (element ``(n - 1) // 2`` of the ``n`` sorted ones, as ``torch.median``)."""
    ordered = torch.sort(values.masked_fill(~present, float("inf")), dim=-1).values
    middle = ((present.sum(-1, keepdim=True) - 1) // 2).clamp(min=0)
    return ordered.gather(-1, middle)


def chunk_entropy(
    scores: torch.Tensor, candidate: torch.Tensor, index: torch.Tensor, cost: torch.Tensor
) -> torch.Tensor:
    """Each chunk's normalised entropy ``[B, Hkv, C]`` fp64 in ``[0, 1]`` of its candidates' scores.

    A chunk holding a negative score is first shifted by its minimum; ``p_t = x_t / (sum x +
    EPSILON)``, ``H = -sum p_t log(p_t + EPSILON) / log n`` over its ``n`` candidates (``cost``),
    0 for ``n <= 1``.

    Args:
        scores: ``[B, Hkv, T]`` fp64, finite on the candidates.
        candidate, index: ``[B, Hkv, T]`` the candidates and each token's chunk.
        cost: ``[B, Hkv, C]`` each chunk's number of candidates.
    """
    x = scores.masked_fill(~candidate, float("inf"))
    low = torch.full(cost.shape, float("inf"), dtype=x.dtype, device=x.device)
    low = low.scatter_reduce(-1, index, x, reduce="amin")
    shifted = (scores - low.clamp(max=0.0).gather(-1, index)).masked_fill(~candidate, 0.0)
    total = torch.zeros_like(low).scatter_add(-1, index, shifted)
    p = shifted / (total.gather(-1, index) + EPSILON)
    terms = (-p * torch.log(p + EPSILON)).masked_fill(~candidate, 0.0)
    h = torch.zeros_like(low).scatter_add(-1, index, terms)
    spread = torch.log(cost.clamp(min=2).to(h.dtype))
    return torch.where(cost > 1, h / spread, 0.0).clamp(0.0, 1.0)


def rank_in_chunk(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's rank ``[B, Hkv, T]`` long within its chunk, by descending ``scores`` (ties:
    the earlier token); -inf tokens rank after every finite one of their chunk."""
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    by_chunk = torch.sort(index.gather(-1, by_score), dim=-1, stable=True).indices
    order = by_score.gather(-1, by_chunk)  # grouped by chunk, best first within each
    sizes = torch.zeros_like(index).scatter_add(-1, index, torch.ones_like(index))
    starts = sizes.cumsum(-1) - sizes
    arange = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    ranked = arange - starts.gather(-1, index.gather(-1, order))
    return torch.zeros_like(index).scatter(-1, order, ranked)


def entropy_gated_keep(
    scores: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor, chunk: int, low: int, shared: bool
) -> torch.Tensor:
    """The kept tokens ``[B, Hkv, T]`` bool of EntropyGatedChunkKV's selection (see
    :class:`EntropyGatedChunkKVSelector`).

    Args:
        scores: ``[B, Hkv, T]``: +inf protected, -inf padding, finite on the candidates.
        counts: ``[B, Hkv]`` long, tokens to keep (the protected ones included).
        positions: ``[B, T]`` each token's position in its sample (-1 on padding).
        chunk: tokens per chunk; low: tokens an important but spiky chunk keeps.
        shared: every head ranks by the candidates' scores summed over the layer's KV heads.
    """
    B, Hkv, T = scores.shape
    protected = scores == float("inf")
    candidate = torch.isfinite(scores)
    x = scores.double().masked_fill(~candidate, 0.0)
    if shared:
        x = x.sum(1, keepdim=True).expand(B, Hkv, T)
    x = torch.where(candidate, x, scores.double())
    index, chunks = chunk_index(positions, chunk, Hkv)
    sums, cost = chunk_totals(x, candidate, index, chunks)
    present = cost > 0
    mean = sums / cost.clamp(min=1)
    entropy = chunk_entropy(x, candidate, index, cost)
    spiky = (mean >= lower_median(mean, present)) & (entropy < lower_median(entropy, present))
    wanted = torch.where(spiky, cost.clamp(max=low), cost)
    # greedy over the chunks by descending mean (ties: the earlier chunk): each takes what it wants
    # of the budget left
    by_mean = mean.masked_fill(~present, float("-inf"))
    order = torch.sort(by_mean, dim=-1, descending=True, stable=True).indices
    ranked_wanted = wanted.gather(-1, order)
    left = (counts - protected.sum(-1))[..., None] - (ranked_wanted.cumsum(-1) - ranked_wanted)
    taken = torch.zeros_like(cost).scatter(-1, order, left.clamp(min=0).minimum(ranked_wanted))
    best = rank_in_chunk(x.masked_fill(~candidate, float("-inf")), index) < taken.gather(-1, index)
    keep = protected | (candidate & best)
    # the budget spiky chunks left unspent: the best candidates not kept yet
    return fill_best(x, keep, counts)


@SELECTORS.register("entropy_gated_chunkkv")
@dataclass
class EntropyGatedChunkKVSelector(ChunkKVSelector):
    """EntropyGatedChunkKV: ChunkKV's chunks, an important but spiky chunk cut to its best tokens.

    Each sample's prompt is cut into chunks of ``chunk`` tokens of its own positions, as
    ``chunkkv``'s. Per (sample, KV head), over the chunks holding candidates (the protected tokens
    are kept anyway and count for nothing): a chunk's score ``m_j`` is the mean of its candidates'
    scores and its gate ``e_j`` the normalised entropy of them (:func:`chunk_entropy`). A chunk is
    *spiky* when ``m_j >= median(m)`` and ``e_j < median(e)`` (lower medians). Chunks are taken in
    descending ``m_j`` (ties: the earlier chunk), each its candidates, a spiky one only its
    ``low_entropy_chunk`` best, and the last only as many of its best as the budget left holds;
    budget the spiky chunks left unspent after every chunk goes to the best candidates not kept
    (ties: the earlier token). Every head keeps exactly its count (kvpress 0.5.5's
    ``EntropyGatedChunkKVPress``, whose budget ``int(T * (1 - ratio))`` is exact too).

    ``heads: each`` (the default, as ``chunkkv``'s) selects per KV head; ``shared`` ranks every
    head by the candidates' scores summed over the layer's KV heads, so the heads keep the same
    tokens (kvpress, which also takes the first sample's selection for the whole batch: kvlab
    selects each sample's own). ``reuse_layers`` as ``chunkkv``'s.

    Shapes: scores ``[B, Hkv, T]`` (+inf protected, -inf padding), counts ``[B, Hkv]`` -> a
    :class:`~kvlab.cache.selection.Selection` of ``counts`` positions per head.
    """

    low_entropy_chunk: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.low_entropy_chunk < self.chunk:
            raise ValueError(
                f"low_entropy_chunk must be >= 1 and below chunk ({self.chunk}), got "
                f"{self.low_entropy_chunk}: a spiky chunk keeps fewer tokens than a whole one "
                f"(set low_entropy_chunk below chunk, e.g. chunk: 10, low_entropy_chunk: 4)"
            )

    def keep(self, scores: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return entropy_gated_keep(
            scores, counts, positions, self.chunk, self.low_entropy_chunk, self.heads == "shared"
        )
