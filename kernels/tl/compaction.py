"""Triton compaction: one pass gathers kept K and V rows into the flat ``[N, D]`` buffers.

Grid ``(B * Hkv * ceil(K / BLOCK_N),)`` (one dimension: at 4M tokens the blocks of one head
alone pass the 65535 limit of grid dimensions 1 and 2): program ``(b*Hkv + h) * blocks + j``
copies kept entries ``j*BLOCK_N ..`` of that head (positions read from ``indices``) to rows
``starts[b, h] + ..``. Offsets are 64-bit. Only ``D`` and the tile sizes are compile-time
constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.tl.common import check_grid, pow2
from kvlab.kernels.types import Compacted, segment_starts

BLOCK_N = 32  # kept rows per program


@triton.jit(do_not_specialize=["n_blocks", "HKV"])
def _compact(
    k_ptr, v_ptr, idx_ptr, counts_ptr, starts_ptr, ok_ptr, ov_ptr, n_blocks, HKV,
    sk_b, sk_h, sk_t, sk_d, si_b, si_h, si_k,
    D: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # 64-bit: b * stride passes 2**31 on long prompts
    bh = pid // n_blocks
    b = bh // HKV
    h = bh % HKV
    j = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = j < tl.load(counts_ptr + bh)
    pos = tl.load(idx_ptr + b * si_b + h * si_h + j * si_k, mask=ok, other=0) if HAS_INDEX else j
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d < D)[None, :]
    src = b * sk_b + h * sk_h + pos[:, None] * sk_t + d[None, :] * sk_d
    dst = (tl.load(starts_ptr + bh) + j)[:, None] * D + d[None, :]
    tl.store(ok_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(ov_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


LAUNCHED = (_compact,)


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
    if N and K:
        index = indices if indices is not None else lengths  # any tensor: unused without HAS_INDEX
        index_strides = indices.stride() if indices is not None else (0, 0, 0)
        n_blocks = triton.cdiv(K, BLOCK_N)
        _compact[check_grid((B * Hkv * n_blocks,))](
            keys, values, index, lengths, starts, out_k, out_v, n_blocks, Hkv,
            *keys.stride(), *index_strides,
            D=D, HAS_INDEX=indices is not None, BLOCK_N=BLOCK_N, BLOCK_D=pow2(D),
        )  # fmt: skip
    return out_k, out_v, starts, lengths
