"""Two-stage selection: a share of each head's budget by one scorer's ranking, the rest by the final score.

A method that trusts one signal for part of the budget and a refined one for the rest (CriticalKV,
Feng et al. 2025, its two-stage selection algorithm: the first stage keeps the highest-attention
entries, the second ranks the remaining ones by the output-perturbation bound) cannot be written
as one score: which entries the first stage takes depends on each head's count, known only after
the head allocator. The ``two_stage`` selector does it after allocation, reading the first stage's scorer
by its role from :attr:`LayerContext.role_scores <kvlab.compression.context.LayerContext.role_scores>`.

Shapes: B batch, Hkv KV heads, T padded prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.modality import group_topk_mask
from kvlab.compression.selectors import SELECTORS, Selector, topk_indices
from kvlab.config.errors import ConfigError


@SELECTORS.register("two_stage")
@dataclass
class TwoStageSelector(Selector):
    """Keep ``floor(share * f)`` entries by the ``first`` role's score, then ``f`` in all by the final score.

    Per (sample, KV head), with ``f`` the head's free count (its count less the entries it must
    keep: ``+inf`` in the final score, the protected window and sinks, or a modality quota's
    choice) among the candidates (finite final score):

    1. stage one: the top ``f1 = floor(share * f)`` candidates by ``ctx.role_scores[first]``;
    2. stage two: the top ``f - f1`` of the other candidates by the final (mixed) score.

    ``share: 0`` is ``topk`` on the final score, ``share: 1`` ``topk`` on the ``first`` role's
    score. Ties go to the lower position in both stages (stable sorts, as ``topk``). Every head
    keeps exactly its count, so the budgets are the allocator's.
    """

    first: str = "attention"
    share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(
                f"share must be in [0, 1] (the first stage's part of a head's budget), got {self.share}"
            )

    def scorer_roles(self) -> tuple[str, ...]:
        return (self.first,)

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        return Selection(indices=topk_indices(self.staged(scores, counts, ctx), counts), counts=counts)

    def staged(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``scores [B, Hkv, T]`` with each head's first-stage entries raised to ``+inf`` (the top
        ``counts [B, Hkv]`` of the result are the two stages' choice)."""
        candidates = torch.isfinite(scores)
        free = (counts - (scores == float("inf")).sum(-1)).clamp(min=0)  # [B, Hkv]
        first_count = torch.floor(free.double() * self.share).long()
        if not bool(((first_count > 0) & (free < candidates.sum(-1))).any()):
            return scores  # every head keeps all its candidates, or stage one is empty
        if self.first not in ctx.role_scores:
            raise ConfigError(
                f"the two_stage selector ranks its first stage by the role '{self.first}', which this layer "
                f"was not scored with (scored roles: {', '.join(ctx.role_scores) or 'none'})."
            )
        first = ctx.role_scores[self.first].float().masked_fill(~candidates, float("-inf"))
        groups = torch.zeros_like(ctx.valid, dtype=torch.long)  # one group: rank every candidate
        chosen = group_topk_mask(first, groups, first_count[..., None])  # [B, Hkv, T]
        return scores.masked_fill(chosen, float("inf"))
