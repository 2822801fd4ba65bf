"""Triton merge: a deterministic segmented reduction (no atomics).

The evicted rows are sorted by target once (stable, in torch), so the entries merging into kept
row ``n`` are one contiguous run ``offsets[n] .. offsets[n] + count[n]``. Program ``n`` sums its
run in a fixed order in fp32 and writes the merged row in the input dtype: the same inputs give
the same bits on every run, unlike ``atomic_add``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.merge import Normalize
from kvlab.kernels.tl.common import pow2


@triton.jit
def _merge(
    kept_ptr, ev_ptr, order_ptr, offsets_ptr, counts_ptr, ew_ptr, kw_ptr, out_ptr,
    D: tl.constexpr, HAS_EW: tl.constexpr, HAS_KW: tl.constexpr, BY_COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    first = tl.load(offsets_ptr + n)
    count = tl.load(counts_ptr + n)
    acc = tl.zeros([BLOCK_D], tl.float32)
    wsum = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, count, BLOCK_M):
        j = j0 + tl.arange(0, BLOCK_M)
        ok = j < count
        src = tl.load(order_ptr + first + j, mask=ok, other=0)
        w = tl.load(ew_ptr + src, mask=ok, other=0.0).to(tl.float32) if HAS_EW else ok.to(tl.float32)
        rows = tl.load(ev_ptr + src[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * rows.to(tl.float32), 0)
        if BY_COUNT:
            wsum += ok.to(tl.float32)
        else:
            wsum += w
    kw = tl.load(kw_ptr + n).to(tl.float32) if HAS_KW else 1.0
    kept = tl.load(kept_ptr + n * D + d, mask=d_ok, other=0.0).to(tl.float32)
    merged = (kw * kept + acc) / (kw + tl.sum(wsum, 0))
    tl.store(out_ptr + n * D + d, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_scatter_triton(
    kept: torch.Tensor,
    evicted: torch.Tensor,
    target: torch.Tensor,
    evicted_weight: torch.Tensor | None = None,
    kept_weight: torch.Tensor | None = None,
    normalize: Normalize = "weights",
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.merge.merge_scatter_reference`."""
    N, D = kept.shape
    kept, evicted = kept.contiguous(), evicted.contiguous()
    order = torch.sort(target, stable=True).indices
    counts = torch.bincount(target, minlength=N)
    offsets = counts.cumsum(0) - counts
    out = torch.empty_like(kept)
    if N:
        _merge[(N,)](
            kept, evicted, order, offsets, counts,
            evicted_weight.contiguous() if evicted_weight is not None else counts,
            kept_weight.contiguous() if kept_weight is not None else counts,
            out,
            D=D, HAS_EW=evicted_weight is not None, HAS_KW=kept_weight is not None,
            BY_COUNT=normalize == "count", BLOCK_M=16, BLOCK_D=pow2(D),
        )  # fmt: skip
    return out
