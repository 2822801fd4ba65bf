"""Triton merge: a deterministic segmented reduction (no atomics), bounded work per program.

The evicted rows are sorted by target once (stable, in torch), so the entries merging into kept
row ``n`` are one contiguous run ``offsets[n] .. offsets[n] + count[n]``. Every program sums at
most ``max_run`` consecutive entries of one run in a fixed order in fp32:

- while some kept row receives more than ``max_run`` entries, its run is cut into pieces of
  ``max_run`` and one launch writes each piece's fp32 partial sums (numerator row and
  denominator); the pieces of a row are contiguous again, so the next level reduces those
  (``ceil(log_max_run(max count))`` levels, one when nothing is that crowded);
- the last launch, one program per kept row, adds the kept row and divides.

The same inputs give the same bits on every run, unlike ``atomic_add``, and one kept row that
absorbs a million evicted entries costs a few short levels instead of one serial program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.tl.common import check_grid, pow2
from kvlab.kernels.types import Normalize

BLOCK_M = 16  # entries loaded per step
MAX_RUN = 1024  # most entries one program sums


@triton.jit(do_not_specialize=["n_rows"])
def _merge(
    src_ptr, order_ptr, first_ptr, count_ptr, w_ptr, den_ptr, kept_ptr, kw_ptr, out_ptr, den_out_ptr,
    n_rows,
    D: tl.constexpr, HAS_W: tl.constexpr, HAS_DEN: tl.constexpr, DEN_IS_W: tl.constexpr,
    FINISH: tl.constexpr, HAS_KW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Sum the run ``order[first[p] .. first[p] + count[p]]`` of ``src`` rows (program ``p``).

    Numerator weights are ``w`` (``HAS_W``) or 1; denominator terms are ``den`` (``HAS_DEN``,
    partials of a previous level), else ``w`` (``DEN_IS_W``) or 1. Without ``FINISH`` the sums
    go to ``out [P, D]`` and ``den_out [P]`` fp32; with it ``p`` is kept row ``n`` and ``out``
    gets ``(kw[n] kept[n] + sum) / (kw[n] + den)`` in the output dtype.
    """
    p = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    first = tl.load(first_ptr + p)
    count = tl.load(count_ptr + p)
    acc = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, count, BLOCK_M):
        j = j0 + tl.arange(0, BLOCK_M)
        ok = j < count
        src = tl.load(order_ptr + first + j, mask=ok, other=0)
        w = tl.load(w_ptr + src, mask=ok, other=0.0).to(tl.float32) if HAS_W else ok.to(tl.float32)
        rows = tl.load(src_ptr + src[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * rows.to(tl.float32), 0)
        if HAS_DEN:
            den += tl.load(den_ptr + src, mask=ok, other=0.0)
        elif DEN_IS_W:
            den += w
        else:
            den += ok.to(tl.float32)
    if FINISH:
        kw = tl.load(kw_ptr + p).to(tl.float32) if HAS_KW else 1.0
        kept = tl.load(kept_ptr + p * D + d, mask=d_ok, other=0.0).to(tl.float32)
        merged = (kw * kept + acc) / (kw + tl.sum(den, 0))
        tl.store(out_ptr + p * D + d, merged.to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        tl.store(out_ptr + p * D + d, acc, mask=d_ok)
        tl.store(den_out_ptr + p, tl.sum(den, 0))


LAUNCHED = (_merge,)


def merge_scatter_triton(
    kept: torch.Tensor,
    evicted: torch.Tensor,
    target: torch.Tensor,
    evicted_weight: torch.Tensor | None = None,
    kept_weight: torch.Tensor | None = None,
    normalize: Normalize = "weights",
    max_run: int = MAX_RUN,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.merge.merge_scatter_reference`.

    ``max_run`` (a multiple of 16) bounds the evicted entries one program sums (tests lower it
    to exercise several reduction levels on small inputs).
    """
    N, D = kept.shape
    dev = kept.device
    kept, evicted = kept.contiguous(), evicted.contiguous()
    out = torch.empty_like(kept)
    if not N:
        return out
    order = torch.sort(target, stable=True).indices
    counts = torch.bincount(target, minlength=N)
    shape = dict(D=D, BLOCK_M=BLOCK_M, BLOCK_D=pow2(D))
    src, weights, den = evicted, evicted_weight.contiguous() if evicted_weight is not None else None, None
    while counts.numel() and int(counts.max()) > max_run:  # one level: runs cut into max_run pieces
        pieces = -(-counts // max_run)
        P = int(pieces.sum())
        owner = torch.repeat_interleave(torch.arange(N, device=dev), pieces)  # [P] kept row of a piece
        piece_first = pieces.cumsum(0) - pieces
        k = torch.arange(P, device=dev) - piece_first[owner]  # index of the piece within its run
        first = (counts.cumsum(0) - counts)[owner] + k * max_run
        count = torch.minimum(counts[owner] - k * max_run, torch.tensor(max_run, device=dev))
        partial = torch.empty(P, D, device=dev, dtype=torch.float32)
        partial_den = torch.empty(P, device=dev, dtype=torch.float32)
        _merge[check_grid((P,))](
            src, order, first, count, weights if weights is not None else count,
            den if den is not None else count, kept, count, partial, partial_den, P,
            HAS_W=weights is not None, HAS_DEN=den is not None, DEN_IS_W=normalize == "weights",
            FINISH=False, HAS_KW=False, **shape,
        )  # fmt: skip
        src, order, weights, den, counts = partial, torch.arange(P, device=dev), None, partial_den, pieces
    _merge[check_grid((N,))](
        src, order, counts.cumsum(0) - counts, counts, weights if weights is not None else counts,
        den if den is not None else counts, kept,
        kept_weight.contiguous() if kept_weight is not None else counts, out, counts, N,
        HAS_W=weights is not None, HAS_DEN=den is not None, DEN_IS_W=normalize == "weights",
        FINISH=True, HAS_KW=kept_weight is not None, **shape,
    )  # fmt: skip
    return out
