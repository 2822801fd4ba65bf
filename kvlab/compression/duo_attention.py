"""DuoAttention (Xiao et al. 2024): retrieval heads keep the whole prompt, streaming heads keep
only the attention sinks and the recent window.

The head allocator reads calibrated per-head scores (``kvlab calibrate --config
duo_attention_heads``, docs/calibration.md) and the budget decides how many heads retrieve, so
that the cache holds exactly the budget (``docs/methods/duo_attention.md``). Shapes: B batch,
L layers, H query heads, Hkv KV heads, G = H / Hkv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import HEAD_ALLOCATORS, HeadAllocator, round_to_total
from kvlab.config import papers
from kvlab.config.artefacts import UsesArtefact


@HEAD_ALLOCATORS.register("duo_attention")
@dataclass
class DuoAttentionHeadAllocator(HeadAllocator, UsesArtefact):
    """DuoAttention's head split on kvlab's budget: a model-wide ranking of the KV heads by their
    calibrated retrieval score; the best keep their whole prompt, the others their protected tokens.

    A streaming head is one with no free token: it keeps exactly the budget's protected tokens,
    ``sinks`` + ``window`` (the paper's attention sinks and recent tokens). Per sample,
    with ``F`` the free budget per head (budget minus protected) and ``C`` the candidates per head
    (prompt minus protected), the model holds ``N F`` free tokens over its ``N = L Hkv`` KV heads,
    and (scores ``s [L, H]`` of a ``duo_attention_heads`` artefact, reduced over each KV head's
    group by ``gqa``, ranked descending, ties to the lower (layer, head) index):

    - ``retrieval_share: null`` (default): heads in rank order keep all ``C`` candidates until the
      ``N F`` tokens run out (the last of them keeps the remainder, its best by the pipeline's
      score). The share of retrieval heads is then ``F / C = (budget - protected) / (prompt -
      protected)``: the budget *is* the paper's sparsity knob (kvpress' ``head_compression_ratio``
      is one minus this share), so kept counts equal the budget and memory falls with it.
    - ``retrieval_share: r`` in (0, 1]: the best ``round(r N)`` heads are retrieval heads and share
      the ``N F`` tokens equally (each at most ``C``, largest-remainder rounding); what they cannot
      hold goes to the streaming heads in rank order. The retrieval heads then keep the pipeline's
      best tokens rather than all of them (a hybrid: DuoAttention's head split with any scorer).

    The allocation is prompt-length dependent but fixed per (``F``, ``C``) and cached. Sliding
    window layers (``sliding_layers: window``) are not allocated. Returns ``[B, Hkv]`` free counts.
    """

    paper: ClassVar[str | None] = papers.DUOATTENTION

    artefact: str = "auto"
    retrieval_share: float | None = None
    gqa: Literal["mean", "max"] = "mean"

    artefact_kind = "duo_attention_heads"

    def __post_init__(self) -> None:
        if self.retrieval_share is not None and not 0.0 < self.retrieval_share <= 1.0:
            raise ValueError(f"retrieval_share must be in (0, 1] or null, got {self.retrieval_share}")
        self._caps: dict[tuple[int, int], torch.Tensor] = {}

    def head_scores(self, scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """``[L, Hkv]`` KV-head scores from the query-head ``scores [L, H]`` (``gqa`` over a group)."""
        grouped = scores.double().view(scores.shape[0], num_kv_heads, -1)
        return grouped.mean(-1) if self.gqa == "mean" else grouped.amax(-1)

    def capacities(self, scores: torch.Tensor, num_kv_heads: int, free: int, available: int) -> torch.Tensor:
        """``[L, Hkv]`` free tokens per KV head for a free budget ``free`` and ``available``
        candidates per head (see the class docstring); sums to ``min(L Hkv free, L Hkv available)``."""
        kv = self.head_scores(scores, num_kv_heads)
        L = kv.shape[0]
        total = L * num_kv_heads * max(free, 0)
        order = torch.sort(kv.reshape(-1), descending=True, stable=True).indices  # [N]
        caps = torch.zeros(L * num_kv_heads, dtype=torch.long, device=kv.device)
        if self.retrieval_share is not None and total > 0:
            count = max(1, round(self.retrieval_share * L * num_kv_heads))
            share = min(total / count, available)
            equal = torch.full((count,), share, device=kv.device)
            caps[order[:count]] = round_to_total(equal, round(share * count))
            total -= int(caps.sum())
        for head in order.tolist():  # the rest, in rank order: whole heads first
            room = min(available - int(caps[head]), total)
            if room <= 0:
                continue
            caps[head] += room
            total -= room
        return caps.view(L, num_kv_heads)

    def allocate(self, scores, free, ctx):
        head_scores = self.artefact_for(ctx).tensors["scores"]
        available = (scores > float("-inf")).sum(-1).amax(-1)  # [B] candidates per head
        counts = torch.empty(scores.shape[0], ctx.num_kv_heads, dtype=torch.long, device=scores.device)
        for b, (budget, room) in enumerate(zip(free.tolist(), available.tolist(), strict=True)):
            key = (budget, room)
            if key not in self._caps:
                self._caps[key] = self.capacities(head_scores, ctx.num_kv_heads, budget, room)
            counts[b] = self._caps[key][ctx.layer_idx].to(scores.device)
        return counts
