"""Selectors: scores and per-head counts -> what the cache keeps.

A :class:`Selection` lists, per (sample, KV head), the kept prompt positions (ascending) and
optionally replacement keys/values for them (merge selectors write merged entries there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.context import LayerContext
from kvlab.config.registry import Registry


@dataclass
class Selection:
    """What one layer keeps.

    Attributes:
        indices: ``[B, Hkv, K]`` long, kept positions in ascending order; entries past
            ``counts[b, h]`` are padding (0) and must be ignored. K = max count.
        counts: ``[B, Hkv]`` long, kept tokens per (sample, head).
        keys / values: optional ``[B, Hkv, K, D]`` replacements for the kept entries (merge
            selectors); None means gather them from the prefill K/V.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """``[B, Hkv, K]`` bool, True on real entries."""
        K = self.indices.shape[-1]
        return torch.arange(K, device=self.counts.device) < self.counts[..., None]

    def kept_mask(self, length: int) -> torch.Tensor:
        """``[B, Hkv, length]`` bool (on the indices' device): which prompt positions each (sample,
        head) kept. Unused slots (index 0 past a row's count) go to a spare column, so they can
        never clear or set position 0."""
        B, Hkv, _ = self.indices.shape
        mask = torch.zeros(B, Hkv, length + 1, dtype=torch.bool, device=self.indices.device)
        mask.scatter_(2, torch.where(self.mask(), self.indices, length), True)
        return mask[..., :length]

    def kept_positions(self, b: int, h: int) -> list[int]:
        """Kept positions of one (sample, head) as a Python list."""
        return self.indices[b, h, : int(self.counts[b, h])].tolist()


class Selector:
    """Base class: override :meth:`select`."""

    registry_name: str = ""

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        """Pick ``counts[b, h]`` tokens per (sample, head).

        Args:
            scores: ``[B, Hkv, T]``; +inf on protected tokens, -inf on padding.
            counts: ``[B, Hkv]`` long, tokens to keep (protected included).
        """
        raise NotImplementedError


SELECTORS: Registry[Selector] = Registry("selector", "model.compression.select")


def topk_indices(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``counts[b, h]`` highest-scoring positions per row, ascending, ``[B, Hkv, max(counts)]``.

    Ties go to the lower position (a stable descending sort), so results do not depend on the
    device's top-k tie order. Padding entries past each row's count are 0.
    """
    k = int(counts.max()) if counts.numel() else 0
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    keep = torch.arange(k, device=scores.device) < counts[..., None]
    big = scores.shape[-1]
    ranked = torch.where(keep, order, torch.full_like(order, big))
    ranked = torch.sort(ranked, dim=-1).values
    return ranked.masked_fill(ranked == big, 0)


@SELECTORS.register("topk")
@dataclass
class TopKSelector(Selector):
    """Evict: keep the ``count`` highest-scoring tokens of each (sample, head); drop the rest."""

    def select(self, scores, counts, ctx):
        return Selection(indices=topk_indices(scores, counts), counts=counts)
