"""Merge selectors: evict like ``topk``, then fold every evicted KV pair into its most similar kept pair.

LOOK-M (Wan et al. 2024, §3.3). Per (sample, KV head): the kept set I (protected tokens
included) and the evicted set E = valid tokens not kept. Each evicted token i is matched to
``c(i) = argmax_{j in I} cos(k_i, k_j)`` (Eq. 9; post-RoPE keys as cached, fp32, eps 1e-6, ties to
the lowest position). With ``S_c`` the tokens matched to c, ``n_c = |S_c|`` and
``s_i = cos(k_i, k_c)``, every kept token is updated from its pre-merge value::

    averaged  (Eq. 10)   k_c <- (k_c + sum_i k_i) / (n_c + 1)
    pivotal   (Eq. 11)   k_c <- (k_c + sum_i (k_i + k_c) / 2) / (n_c + 1)
    weighted  (Eq. 12)   k_c <- (k_c + sum_i s_i k_i) / (n_c + 1)

and the same for values with the same matches and weights (``v_c``, ``v_i``; pivotal uses
``v_c``). Kept tokens nobody is matched to are unchanged, so the cache holds exactly the
budgeted entries and merging a token into an identical one is the identity. All three rules
are one call of :func:`kvlab.kernels.merge.merge_scatter` (Triton on CUDA, torch elsewhere) over
the layer's flat kept and evicted rows: ``(x_c + sum_i src_i) / (n_c + 1)`` with ``src`` the
evicted rows (averaged), their pivot averages (pivotal) or the rows weighted by ``s_i`` with a
count denominator (weighted), i.e. the release's ``scatter_reduce(mean, include_self=True)``.

Paper-vs-code choices (``docs/methods/lookm.md``): no similarity filter by default (the
release drops evicted tokens whose head-mean max similarity is below the mean in the averaged
and weighted variants; ``filter: mean_max_sim`` is a corrected per-(sample, head) version), and
no misaligned averaged merge (the release adds the first evicted tokens to the targets of the
filtered ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.selectors import SELECTORS, Selector, topk_indices
from kvlab.config import papers
from kvlab.kernels.merge import merge_scatter

EPS = 1e-6


def match_evicted(
    keys: torch.Tensor, kept: torch.Tensor, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest kept token by key cosine for every position, ``([B, Hkv, T] long, [B, Hkv, T] fp32)``.

    ``keys [B, Hkv, T, D]``, ``kept [B, Hkv, T]`` bool. Returns the position of the most similar
    kept key and the similarity (ties to the lowest position); computed ``chunk`` rows at a time
    so the ``T x T`` similarity is never materialised. Rows of heads with nothing kept are
    meaningless.
    """
    unit = F.normalize(keys.float(), dim=-1, eps=EPS)
    T = keys.shape[2]
    targets = torch.zeros(kept.shape, dtype=torch.long, device=keys.device)
    best = torch.zeros(kept.shape, dtype=torch.float32, device=keys.device)
    for start in range(0, T, chunk):
        sim = torch.matmul(unit[:, :, start : start + chunk], unit.transpose(-1, -2))  # [B, Hkv, c, T]
        sim = sim.masked_fill(~kept[:, :, None, :], float("-inf"))
        value, index = sim.max(-1)  # first maximum: ties go to the lowest position
        targets[:, :, start : start + chunk] = index
        best[:, :, start : start + chunk] = value
    return targets, best


@SELECTORS.register("merge")
@dataclass
class MergeSelector(Selector):
    """LOOK-M merge: keep the top ``count`` tokens (as ``topk``); merge each evicted one into its nearest.

    ``rule``: averaged | pivotal | weighted (see the module docstring for the formulas).
    ``filter``: ``none`` (paper) or ``mean_max_sim`` (merge only evicted tokens whose best
    similarity is at least the mean best similarity of their (sample, head); the others are
    dropped). Shapes: scores ``[B, Hkv, T]`` -> Selection with ``keys/values [B, Hkv, K, D]``.
    """

    paper: ClassVar[str | None] = papers.LOOKM

    rule: Literal["averaged", "pivotal", "weighted"] = "pivotal"
    filter: Literal["none", "mean_max_sim"] = "none"
    chunk: int = 512

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        indices = topk_indices(scores, counts)
        selection = Selection(indices=indices, counts=counts)
        slots = selection.mask()  # [B, Hkv, K]
        kept = selection.kept_mask(scores.shape[-1])  # [B, Hkv, T]
        evicted = ctx.valid[:, None, :] & ~kept
        if not bool(evicted.any()):
            return selection
        target_pos, similarity = match_evicted(ctx.keys, kept, self.chunk)
        if self.filter == "mean_max_sim":
            sims = similarity.masked_fill(~evicted, 0.0)
            mean = sims.sum(-1, keepdim=True) / evicted.sum(-1, keepdim=True).clamp(min=1)
            evicted = evicted & (similarity >= mean)
        # row of each kept position in the flat [N, D] layout (order: sample, head, position)
        flat_counts = counts.flatten()
        starts = (flat_counts.cumsum(0) - flat_counts).view_as(counts)
        slot_of = kept.long().cumsum(-1) - 1  # [B, Hkv, T]
        target_row = starts[..., None] + slot_of.gather(-1, target_pos)
        target = target_row[evicted]  # [M]
        weight = similarity[evicted]  # [M]
        D = ctx.keys.shape[-1]
        gather = indices[..., None].expand(-1, -1, -1, D)
        merged = []
        for x in (ctx.keys, ctx.values):
            x32 = x.float()
            kept_rows = x32.gather(2, gather)[slots]  # [N, D]
            src = x32[evicted]  # [M, D]
            if self.rule == "pivotal":
                src = (src + kept_rows[target]) / 2
            if self.rule == "weighted":
                rows = merge_scatter(kept_rows, src, target, evicted_weight=weight, normalize="count")
            else:
                rows = merge_scatter(kept_rows, src, target)
            out = torch.zeros(*indices.shape, D, dtype=x.dtype, device=x.device)
            out[slots] = rows.to(x.dtype)
            merged.append(out)
        selection.keys, selection.values = merged
        return selection
