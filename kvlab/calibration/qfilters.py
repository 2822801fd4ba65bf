"""The ``qfilters`` calibration statistic: each KV head's Q-Filter (Godey et al. 2025).

For layer ``l`` and KV head ``h``, ``Q`` is the matrix whose rows are the rotated queries (as the
layer's attention sees them, after the rotary embedding: the keys they are compared with are the
rotated keys of the cache) of the head's ``G`` query heads at every valid prompt position of every
calibration prompt. The Q-Filter is ``Q``'s first right singular vector ``v_1``, signed so that
the queries' mean projection on it is positive (the paper's ``u_h``, Observation 1). kvlab
accumulates the Gram matrix ``Q^T Q`` ``[D, D]`` in fp64 over the prompts instead of holding
``Q``: its top eigenvector is ``v_1`` (``Q = U S V^T`` gives ``Q^T Q = V S^2 V^T``), so the result
is the SVD's with a memory of ``L Hkv D^2`` numbers whatever the calibration set.

Artefact tensors: ``filters [L, Hkv, D]`` fp32 (unit vectors) and ``explained [L, Hkv]`` fp32, the
share ``s_1^2 / sum_i s_i^2`` of the queries' energy along the filter (how anisotropic the head
is). The consumer is :class:`kvlab.compression.qfilters.QFiltersScorer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, CalibrationStatistic
from kvlab.compression.context import LayerContext


@CALIBRATIONS.register("qfilters")
@dataclass
class QueryDirections(CalibrationStatistic):
    """Q-Filters ``filters [L, Hkv, D]`` and ``explained [L, Hkv]`` (see the module docstring)."""

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._shape = (num_layers, num_kv_heads)
        self._gram: torch.Tensor | None = None  # [L, Hkv, D, D] fp64, sized at the first layer seen
        self._sum: torch.Tensor | None = None  # [L, Hkv, D] fp64

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        B, Hkv, G, T = ctx.batch_size, ctx.num_kv_heads, ctx.group_size, ctx.seq_len
        queries = ctx.last_queries(T, "the qfilters statistic (every prompt query)").double()
        D = queries.shape[-1]
        if self._gram is None:
            self._gram = torch.zeros(*self._shape, D, D, dtype=torch.float64)
            self._sum = torch.zeros(*self._shape, D, dtype=torch.float64)
        rows = queries.view(B, Hkv, G, T, D) * ctx.valid[:, None, None, :, None]  # padding rows zeroed
        self._gram[ctx.layer_idx] += torch.einsum("bhgtd,bhgte->hde", rows, rows).cpu()
        self._sum[ctx.layer_idx] += rows.sum((0, 2, 3)).cpu()

    def result(self) -> dict[str, torch.Tensor]:
        if self._gram is None or self._sum is None:
            raise ValueError("the qfilters statistic saw no layer: the calibration set is empty")
        return dict(zip(("filters", "explained"), query_filters(self._gram, self._sum), strict=True))


def query_filters(gram: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q-Filters from the queries' Gram matrices ``gram [..., D, D]`` and sums ``total [..., D]``:
    ``(filters [..., D], explained [...])`` fp32, the top eigenvector signed so ``total . u > 0``
    (a zero projection keeps the eigensolver's sign) and its share of the trace."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # ascending
    top = eigenvectors[..., -1]  # [..., D]
    sign = torch.where((total * top).sum(-1) < 0, -1.0, 1.0).to(top.dtype)
    explained = eigenvalues[..., -1] / eigenvalues.sum(-1).clamp(min=torch.finfo(gram.dtype).tiny)
    return (top * sign[..., None]).float(), explained.float()
