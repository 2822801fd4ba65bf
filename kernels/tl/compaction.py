"""Triton compaction: one pass gathers kept K and V rows into the flat ``[N, D]`` buffers.

Grid ``(B * Hkv, ceil(K / BLOCK_N))``: program ``(b*Hkv + h, j)`` copies kept entries
``j*BLOCK_N ..`` of that head (positions read from ``indices``) to rows ``starts[b, h] + ..``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.compaction import Compacted, segment_starts
from kvlab.kernels.tl.common import pow2


@triton.jit
def _compact(
    k_ptr, v_ptr, idx_ptr, counts_ptr, starts_ptr, ok_ptr, ov_ptr,
    sk_b, sk_h, sk_t, sk_d, si_b, si_h, si_k,
    HKV: tl.constexpr, D: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < tl.load(counts_ptr + bh)
    pos = tl.load(idx_ptr + b * si_b + h * si_h + j * si_k, mask=ok, other=0) if HAS_INDEX else j
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d < D)[None, :]
    src = b * sk_b + h * sk_h + pos[:, None] * sk_t + d[None, :] * sk_d
    dst = (tl.load(starts_ptr + bh) + j)[:, None] * D + d[None, :]
    tl.store(ok_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(ov_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def compact_kv_triton(
    keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None, counts: torch.Tensor
) -> Compacted:
    """Triton version of :func:`~kvlab.kernels.compaction.compact_kv_reference`."""
    B, Hkv, T, D = keys.shape
    if values.stride() != keys.stride():
        keys, values = keys.contiguous(), values.contiguous()
    lengths = counts.to(torch.int64).contiguous()
    starts = segment_starts(lengths)
    N = int(lengths.sum())
    out_k = keys.new_empty(N, D)
    out_v = values.new_empty(N, D)
    K = indices.shape[-1] if indices is not None else T
    block_n = 32
    if N and K:
        index = indices if indices is not None else lengths  # any tensor: unused without HAS_INDEX
        index_strides = indices.stride() if indices is not None else (0, 0, 0)
        _compact[(B * Hkv, triton.cdiv(K, block_n))](
            keys, values, index, lengths, starts, out_k, out_v,
            *keys.stride(), *index_strides,
            HKV=Hkv, D=D, HAS_INDEX=indices is not None, BLOCK_N=block_n, BLOCK_D=pow2(D),
        )  # fmt: skip
    return out_k, out_v, starts, lengths
