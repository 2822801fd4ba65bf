"""Selectors: scores and per-head counts -> what the cache keeps.

A :class:`~kvlab.cache.selection.Selection` (a storage-layer type: the cache stores it) lists, per
(sample, KV head), the kept prompt positions (ascending) and optionally replacement keys/values
for them (merge selectors write merged entries there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.config.capabilities import Component
from kvlab.config.registry import Registry


class Selector(Component):
    """Base class: override :meth:`select`.

    ``offloads``: the selector keeps K/V outside the compressed cache (a ``Selection.offloaded``
    store, the ``retrieve`` selector), which a quantizer does not reach (the pipeline refuses the two).
    ``keeps_counts``: every (sample, head) keeps exactly the count it is given (True by default); a
    selector whose counts are caps (``threshold``: the entries above a score) says False, and its
    ``Selection.counts`` are what it kept.
    """

    offloads: ClassVar[bool] = False
    keeps_counts: ClassVar[bool] = True

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        """Pick ``counts[b, h]`` tokens per (sample, head).

        Args:
            scores: ``[B, Hkv, T]``; +inf on protected tokens, -inf on padding.
            counts: ``[B, Hkv]`` long, tokens to keep (protected included).
        """
        raise NotImplementedError

    def scorer_roles(self) -> tuple[str, ...]:
        """The scorer roles this selector ranks by besides its ``scores`` (read from
        :attr:`LayerContext.role_scores <kvlab.compression.context.LayerContext.role_scores>`); the
        pipeline refuses a config where one is not a scorer's role. None by default."""
        return ()


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
