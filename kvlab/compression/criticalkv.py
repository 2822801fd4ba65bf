"""CriticalKV (Feng et al. 2025): the output-perturbation bound's value term, ``||W_o^h v_t||_1``.

Evicting entries of a head perturbs its attention output after the output projection; the paper's
L1 bound on that perturbation falls as ``sum_kept A_t ||v_t W_o^h||_1`` grows, so an entry with a
small attention weight but a large projected value can matter more than its weight says.
The method (kvpress' ``CriticalAdaKVPress``) is assembled from general components:

- ``importance.attention``: SnapKV's pooled window attention ``A_t`` (AdaKV's settings);
- ``importance.projected``: :class:`ProjectedValueNorm`, ``||W_o^h v_t||_1`` (this module), read
  from the model fact ``projections``;
- ``mixer: product`` with ``offsets: {attention: epsilon}``: ``(A_t + epsilon) ||W_o^h v_t||_1``;
- ``allocate.head: adakv`` on ``signal: attention``: AdaKV's head budgets from the attention alone;
- ``select: two_stage`` (:mod:`kvlab.compression.two_stage`): stage one keeps each head's top
  ``floor(share * f)`` entries by attention, stage two the rest by the product.

``docs/methods/criticalkv.md`` writes out the equations, the reference's settings and where kvlab
departs from the paper and the code. Against kvpress 0.5.5 around ``SnapKVPress`` (window 8) on the
tiny models (``tests/fixtures/kvpress/``): AdaKV's head budgets are the same, and so are the kept
positions wherever stage one keeps as many by attention. The one difference is what stage one's
share is of: kvpress keeps ``int(0.5 b_j)`` of a head's budget with SnapKV's window (scored the
maximum) inside, ``int(0.5 b_j) - w`` by attention; kvlab ``floor(share f_j)`` of the
``f_j = b_j - w`` beyond the protected window, ``floor(f_j / 2)`` in the preset: ``w / 2`` more
by attention for an even window (4 for a window of 8: the preset's kept sets overlap kvpress's
with a Jaccard index of 0.70 to 0.76 per head at worst). kvlab at a ``share`` at which both
counts agree (0.3 on uniform budgets of 27) keeps kvpress's positions in every layer and head.
Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv,
T padded prompt length, D head dim, E hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("projected_value_norm")
@dataclass
class ProjectedValueNorm(ImportanceScorer):
    """``||W_o^h v_t||_p`` averaged over the G query heads of each KV head, ``[B, Hkv, T]`` fp32.

    ``W_o^h`` ``[E, D]`` is the block of the layer's output projection ``o_proj.weight`` ``[E, H*D]``
    that query head ``h`` writes through (columns ``h D .. (h + 1) D - 1``); query head ``h``
    reads KV head ``h // G``, so KV head ``j``'s score is
    ``(1/G) sum_{h: h // G = j} ||W_o^h v_{j,t}||_p`` (kvpress' ``vwl1norm``: per query head, then
    the group mean). ``norm: 1`` is the L1 norm of the paper's bound and of the reference code;
    ``norm: 2`` the Euclidean one. Computed in fp32 one query head at a time (never ``[B, H, T, E]``).

    Reads the model fact ``projections`` (a model without separate q/k/v/o linears is refused
    before the prefill) and only the values, so a chunked prefill may run it.
    """

    paper: ClassVar[str | None] = papers.CRITICALKV

    norm: int = 1

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True, model_facts=("projections",))

    def __post_init__(self) -> None:
        if self.norm not in (1, 2):
            raise ValueError(f"norm must be 1 (L1, the paper's bound) or 2 (Euclidean), got {self.norm}")

    def score(self, ctx: LayerContext) -> torch.Tensor:
        B, Hkv, T, D = ctx.values.shape
        H, G = ctx.num_heads, ctx.group_size
        out_proj = ctx.facts.projections.o  # [E, H*D]
        per_head = out_proj.float().view(out_proj.shape[0], H, D)  # [E, H, D]
        values = ctx.values.float().to(out_proj.device)
        total = torch.zeros(B, Hkv, T, dtype=torch.float32, device=out_proj.device)
        for h in range(H):
            projected = values[:, h // G] @ per_head[:, h].T  # [B, T, E]
            total[:, h // G] += torch.linalg.vector_norm(projected, ord=self.norm, dim=-1)
        return (total / G).to(ctx.values.device)
