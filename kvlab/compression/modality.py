"""Modality allocators: split each head's free budget between text and vision tokens.

A modality allocator sees the candidate scores (protected tokens and padding at -inf) and the
head allocator's counts, and returns a :class:`ModalityQuota`: a group id per token and how
many candidates each (sample, head) keeps from each group. The pipeline then takes the top
``quota[b, h, g]`` candidates *within* each group g (:func:`group_topk_mask`), so scores are
only ever compared inside a group and no additive constant is mixed into them (the LOOK-M
release's -65516 prior collapses to ties in bf16; see ``docs/methods/lookm.md``).

Groups are built from the modality ids (0 text, 1 image, 2 video, -1 padding): text is group
0 and vision (image and video together, one set V as in DAVID and LOOK-M) is group 1.
Vision markers such as ``<|vision_start|>`` are text (their ids are not image ids). A prompt
without vision tokens has an empty group 1 and both allocators degrade to the modality-blind
selection of the head's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import MODALITY_ALLOCATORS, ModalityAllocator
from kvlab.compression.context import LayerContext
from kvlab.config import papers

TEXT_GROUP, VISION_GROUP = 0, 1


@dataclass
class ModalityQuota:
    """Per-group budgets of one layer.

    Attributes:
        groups: ``[B, T]`` long, the group of each token (0 text, 1 vision, -1 padding).
        quota: ``[B, Hkv, G]`` long, candidates kept from each group per (sample, KV head);
            never more than the group's candidates.
    """

    groups: torch.Tensor
    quota: torch.Tensor


def modality_groups(modality: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` modality ids -> groups: 0 text, 1 vision (image or video), -1 padding."""
    groups = torch.where(modality > 0, VISION_GROUP, TEXT_GROUP)
    return groups.masked_fill(modality < 0, -1)


def group_candidates(scores: torch.Tensor, groups: torch.Tensor, num_groups: int = 2) -> torch.Tensor:
    """Candidates (finite or +inf score) per group, ``[B, Hkv, G]`` long, from scores ``[B, Hkv, T]``."""
    candidate = scores > float("-inf")
    return torch.stack([(candidate & (groups == g)[:, None, :]).sum(-1) for g in range(num_groups)], -1)


def group_topk_mask(scores: torch.Tensor, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, T]`` bool: the top ``quota[b, h, g]`` candidates of each group g (scores compared within g).

    Ties go to the lower position (stable sort), as in :func:`~kvlab.compression.selectors.topk_indices`.
    """
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for g in range(quota.shape[-1]):
        in_group = (groups == g)[:, None, :] & (scores > float("-inf"))
        masked = scores.masked_fill(~in_group, float("-inf"))
        order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
        ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)
        keep |= in_group & (rank < quota[..., g : g + 1])
    return keep


@MODALITY_ALLOCATORS.register("text_prior")
@dataclass
class TextPriorAllocator(ModalityAllocator):
    """LOOK-M's text prior (Wan et al. 2024, Eq. 5-8): text first, then vision by score.

    Per (sample, KV head) with N free tokens (budget minus the protected window and sinks),
    ``c_T`` text and ``c_V`` vision candidates::

        keep_all_text:  q_T = c_T                 q_V = min(c_V, max(0, N - c_T))
        strict:         q_T = min(c_T, N)         q_V = min(c_V, N - q_T)

    ``keep_all_text`` is the paper's union ("I = text ∪ Top_N") and the released code: every
    text token is kept even past the budget, so a head keeps ``max(N, c_T) + protected``.
    The effective kept fraction is then above the nominal one; it is reported per layer and
    head (``LayerReport.kept``, the records' ``kept_per_layer_head`` and ``kv_ratio``).
    ``strict`` ranks text by score and truncates it to N, so the budget is hard. The window is
    protected by the budget (``budget.window``) whatever its modality. Works with any
    importance scorer (LOOK-M uses ``cumulative_attention``).
    """

    paper: ClassVar[str | None] = papers.LOOKM

    overflow: Literal["keep_all_text", "strict"] = "keep_all_text"

    def allocate(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> ModalityQuota:
        """``scores [B, Hkv, T]`` candidates (-inf elsewhere), ``counts [B, Hkv]`` free budget."""
        groups = modality_groups(ctx.modality)
        available = group_candidates(scores, groups)  # [B, Hkv, 2]
        text, vision = available[..., TEXT_GROUP], available[..., VISION_GROUP]
        q_text = text if self.overflow == "keep_all_text" else torch.minimum(text, counts)
        q_vision = torch.minimum(vision, torch.clamp(counts - q_text, min=0))
        return ModalityQuota(groups, torch.stack([q_text, q_vision], -1))


@MODALITY_ALLOCATORS.register("decoupled")
@dataclass
class DecoupledAllocator(ModalityAllocator):
    """DAVID's decoupled eviction (Gu et al. 2026, Eq. 4-5): separate vision and text budgets.

    With B_s free tokens per head and the vision:text ratio ``rho`` = B_s^V / B_s^T::

        text semantics (default):   B_s^V = floor(rho * B_s / (1 + rho))
        algorithm1:                 B_s^V = floor(B_s / (1 + rho))      (the paper's Alg. 1 line 28)
        B_s^T = B_s - B_s^V

    Each part is clamped to its modality's candidates; with ``spill`` the shortfall goes to
    the other modality so the head still keeps B_s (the paper leaves a short modality open; kvlab
    keeps the head's budget). Scores are compared only within a modality (the other one is
    masked with -inf, not zeroed, so a zero score is never mistaken for a weak one); any pooling the
    scorer does happens before the split (Alg. 1 order). Without vision tokens this is the
    unified top-B_s.
    """

    paper: ClassVar[str | None] = papers.DAVID

    rho: float = 2.0
    rho_semantics: Literal["text", "algorithm1"] = "text"
    spill: bool = True

    def __post_init__(self) -> None:
        if not self.rho > 0 or math.isinf(self.rho):
            raise ValueError(f"rho must be a positive finite vision:text ratio, got {self.rho}")

    def allocate(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> ModalityQuota:
        """``scores [B, Hkv, T]`` candidates (-inf elsewhere), ``counts [B, Hkv]`` free budget."""
        groups = modality_groups(ctx.modality)
        available = group_candidates(scores, groups)
        text, vision = available[..., TEXT_GROUP], available[..., VISION_GROUP]
        share = self.rho / (1 + self.rho) if self.rho_semantics == "text" else 1 / (1 + self.rho)
        want_vision = torch.floor(counts.double() * share + 1e-9).long()
        want_text = counts - want_vision
        q_vision = torch.minimum(want_vision, vision)
        q_text = torch.minimum(want_text, text)
        if self.spill:
            q_vision = torch.minimum(vision, q_vision + (want_text - q_text))
            q_text = torch.minimum(text, counts - q_vision)
        return ModalityQuota(groups, torch.stack([q_text, q_vision], -1))
