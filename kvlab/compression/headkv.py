"""HeadKV (Fu et al. 2024, "Not All Heads Matter"): per-head budgets from calibrated
retrieval-reasoning head scores, a base budget for every head plus a shared pool by importance.

The scores come from ``kvlab calibrate --config retrieval_reasoning_heads``
(:class:`~kvlab.calibration.retrieval_heads.RetrievalReasoningScores`); ``docs/methods/headkv.md``
has the equations and the reference code's settings. Shapes: L layers, H query heads, Hkv KV
heads, B batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import HEAD_ALLOCATORS, StaticHeadAllocator
from kvlab.config import papers


@HEAD_ALLOCATORS.register("headkv")
@dataclass
class HeadKVHeadAllocator(StaticHeadAllocator):
    """HeadKV's head-level budgets (Fu et al. 2024, the head-level allocation).

    With ``B'`` the free budget per head (kvlab's budget minus the window), HeadKV takes a slice
    ``B' // beta`` of every head's budget into a pool shared by all ``L H`` heads and hands it back
    in proportion to the heads' importance scores::

        s = scores / sum(scores) ; s = s ** temp / sum(s ** temp)    # over all L H query heads
        b_min = B' - B' // beta ;  pool = (B' // beta) L H
        cap = s pool + b_min                                        # rounded

    (``ReasonSnapKVCluster`` in the authors' release; their default ``beta`` 1.01 pools nearly the
    whole budget, ``temp`` 1). kvlab stores one cache per KV head, so a KV head gets its group's
    summed share (``gqa: sum``) and the pool is ``(B' // beta) L Hkv``: the total over the model is
    ``L Hkv B'``, exact by largest-remainder rounding (``rounding: nearest`` is the release's
    ``round``). Caps above a head's candidates are clamped. The rule is
    :class:`~kvlab.compression.allocators.StaticHeadAllocator`'s (SparseMM's, which follows HeadKV's
    code) with ``min_cache = B' - B' // beta`` and tempered shares.

    Scores: ``scores [L, H]`` of a ``retrieval_reasoning_heads`` artefact. Returns ``[B, Hkv]``.
    """

    paper: ClassVar[str | None] = papers.HEADKV

    artefact: str = "auto"
    beta: float = 1.01
    temp: float = 1.0
    gqa: Literal["sum", "mean"] = "sum"
    rounding: Literal["exact_total", "nearest"] = "exact_total"

    artefact_kind = "retrieval_reasoning_heads"

    def __post_init__(self) -> None:
        if self.beta < 1.0:
            raise ValueError(f"beta must be >= 1 (the pool takes B' // beta of each head), got {self.beta}")
        if self.temp <= 0:
            raise ValueError(f"temp must be > 0, got {self.temp}")
        super().__post_init__()

    def shares(self, head_scores: torch.Tensor) -> torch.Tensor:
        tempered = super().shares(head_scores) ** self.temp
        return tempered / tempered.sum()

    def min_cache(self, budget: int) -> int:
        return budget - int(budget // self.beta)
