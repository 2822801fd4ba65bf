"""Triton decode attention over a quantized layer, reading the packed codes inside the kernel.

Launcher :func:`packed_decode_attention_triton`: the attention
:func:`kvlab.cache.packed.packed_decode_attention` computes (its torch path dequantizes the body
chunk by chunk, then attends), without writing any dequantized entry to memory. The layer's
:class:`~kvlab.cache.packed.PackedPrompt` holds, per (sample, KV head) segment, a body of uniform
asymmetric codes (KIVI's and ``per_token``'s :class:`~kvlab.compression.quantizers.GroupCodes`:
``b``-bit codes packed ``8 / b`` per byte, the first in the low bits, with a scale and zero point
per group of rows or of channels), or of TurboQuant codes
(:class:`~kvlab.compression.turboquant.RotatedCodes`), and a full-precision residual; decoded
tokens sit in the decode region.

Split-K over three parts, one set of partials (:class:`~kvlab.kernels.tl.decode_attention.Partials`):

- :func:`_packed_partial`, grid ``(B * Hkv, S_body)``: program ``(bh, s)`` loads the ``G * q``
  queries of KV head ``h`` once and runs an online softmax over body rows
  ``[s * split, (s + 1) * split)`` of its segment; each ``[BLOCK_N, BLOCK_D]`` key and value tile
  is loaded as its bytes, shifted and masked into codes, and turned into ``q s + z`` (fp32, then
  the entries' dtype, as the torch path rounds) in registers, then fed to ``tl.dot``; over
  TurboQuant codes the body program is
  :func:`~kvlab.kernels.tl.rotated_attention.launch_rotated_partials`' instead (the query rotated
  once, the body attended in the rotated basis, its accumulators rotated back);
- the ragged decode kernel's partial program over the residual and the decode region
  (:func:`~kvlab.kernels.tl.decode_attention.launch_ragged_partials`), in the splits after the body's;
- the decode kernel's combine, merging every split by log-sum-exp.

The bit width, the group sizes and the parameter strides are runtime arguments (one compilation
per dtype and head dim serves int8, int4 and int2, per-channel and per-token groups). Loop-invariant
per column: the byte ``d // (8 / b)`` and the shift ``(d mod (8 / b)) b`` of channel ``d``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import dot_upcast
from kvlab.kernels.tl.common import (
    EMPTY,
    LOG2E,
    check_grid,
    dot,
    dot_precision,
    head_block,
    launch_options,
    pow2,
)
from kvlab.kernels.tl.decode_attention import (
    Partials,
    combine,
    launch_ragged_partials,
    load_queries,
    softmax_step,
    splits_for,
    store_partial,
)
from kvlab.kernels.tl.rotated_attention import launch_rotated_partials
from kvlab.kernels.types import RotatedCodebookCodes, UniformCodes

#: body rows per tile and software-pipeline stages. Each tile's codes, scales and zero points
#: (gathered per element) and their addresses sit in registers: 64-row tiles in two stages spilled
#: 352-1136 bytes per thread at head dims 64 and 128 on sm_80 and sm_90; 32 rows in one stage
#: compile without spills (186-230 registers, tests/kernels/test_kernel_compile.py)
PACKED_BLOCK_N = 32
STAGES = 1
#: fewest warps in 16 bits: with 2 (the ragged kernel's choice up to 32-wide heads) sm_80 spilled 8
#: bytes a thread at head dim 16 (fp32 keeps 2: with 4 it spilled 16)
MIN_WARPS_16BIT = 4


@triton.jit
def _dequantize(
    codes_ptr, scale_ptr, zero_ptr, rows, ok, byte, shift, low, code_stride, row_group, col_group,
    param_stride, d, d_ok,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_D]`` entries of body rows ``rows`` (zero where not ``ok``): codes unpacked
    from their bytes, ``q s + z`` in fp32, rounded to the entries' dtype (the scales')."""
    mask = ok[:, None] & d_ok[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * code_stride + byte[None, :], mask=mask, other=0)
    codes = (packed.to(tl.int32) >> shift[None, :]) & low
    at = (rows // row_group)[:, None] * param_stride + (d // col_group)[None, :]
    scale = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return (codes.to(tl.float32) * scale + zero).to(scale_ptr.dtype.element_ty)


@triton.jit(
    do_not_specialize=[
        "split", "n_splits", "Q", "HKV", "G", "bits", "code_stride",
        "k_rows", "k_cols", "k_stride", "v_rows", "v_cols", "v_stride",
    ]
)  # fmt: skip
def _packed_partial(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, starts_ptr, lengths_ptr,
    part_acc, part_m, part_l,
    scale_log2, split, n_splits, Q, HKV, G,
    bits, code_stride, k_rows, k_cols, k_stride, v_rows, v_cols, v_stride,
    sq_b, sq_h, sq_q, sq_d,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    q, _ = load_queries(q_ptr, bh, HKV, G, Q, sq_b, sq_h, sq_q, sq_d, D, ROWS, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    per_byte = 8 // bits
    byte = d // per_byte
    shift = (d % per_byte) * bits
    low = (1 << bits) - 1

    start = tl.load(starts_ptr + bh).to(tl.int64)
    length = tl.load(lengths_ptr + bh).to(tl.int32)
    lo = s * split
    hi = tl.minimum(lo + split, length)

    m = tl.full([ROWS], EMPTY, tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < hi
        rows = start + pos
        k = _dequantize(kc_ptr, ks_ptr, kz_ptr, rows, ok, byte, shift, low, code_stride, k_rows, k_cols,
                        k_stride, d, d_ok).to(q.dtype)  # fmt: skip
        p, alpha, m, lsum = softmax_step(q, k, ok[None, :], m, lsum, scale_log2, UPCAST, PRECISION)
        v = _dequantize(vc_ptr, vs_ptr, vz_ptr, rows, ok, byte, shift, low, code_stride, v_rows, v_cols,
                        v_stride, d, d_ok).to(q.dtype)  # fmt: skip
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, UPCAST, PRECISION)

    r = tl.arange(0, ROWS)
    idx = (bh * n_splits + s) * (G * Q) + r
    store_partial(part_acc, part_m, part_l, idx, m, lsum, acc, r < G * Q, D, BLOCK_D)


LAUNCHED = (_packed_partial,)


def _groups(codes: UniformCodes) -> tuple[int, int, int]:
    """``(rows, channels, stride)``: the rows and channels sharing one parameter, and the parameters'
    row stride (``along: tokens``: ``[M / group, D]``; ``channels``: ``[M, D / group]``)."""
    rows, cols = (codes.group, 1) if codes.along == "tokens" else (1, codes.group)
    return rows, cols, codes.scale.stride(0)


def packed_decode_attention_triton(
    query: torch.Tensor,
    keys: UniformCodes | RotatedCodebookCodes,
    values: UniformCodes | RotatedCodebookCodes,
    body_starts: torch.Tensor,
    body_lengths: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_starts: torch.Tensor,
    residual_lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    widths: tuple[int, int] | None = None,
    split_size: int | None = None,
    slots: int | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, H, q, D]`` over a quantized layer -> ``[B, H, q, D]`` (query dtype).

    Args:
        keys / values: the body's codes (``M`` rows), both :class:`~kvlab.kernels.types.UniformCodes`
            (bits in {1, 2, 4, 8}, scales and zero points in the entries' dtype: :func:`_packed_partial`)
            or both :class:`~kvlab.kernels.types.RotatedCodebookCodes` (TurboQuant: the rotated-basis
            program of :mod:`kvlab.kernels.tl.rotated_attention`).
        body_starts / body_lengths: ``[B, Hkv]`` each segment's rows in the codes.
        residual_keys / residual_values: ``[Nr, D]`` the full-precision residual, segments
            ``residual_starts / residual_lengths [B, Hkv]``.
        decode_keys / decode_values, decode_length, scaling: as
            :func:`~kvlab.kernels.decode_attention.ragged_decode_attention_reference`.
        widths: ``(longest body, longest residual)`` if the caller knows them (saves a sync).
        split_size / slots: as :func:`~kvlab.kernels.tl.decode_attention.ragged_decode_attention_triton`,
            for both the body's and the residual's splits.
    """
    B, H, q, D = query.shape
    Hkv = body_starts.shape[1]
    uniform = isinstance(keys, UniformCodes) and isinstance(values, UniformCodes)
    rotated = isinstance(keys, RotatedCodebookCodes) and isinstance(values, RotatedCodebookCodes)
    if not (uniform or rotated):
        raise ValueError(
            f"packed_decode_attention_triton: keys and values must be both uniform or both TurboQuant "
            f"codes, got {type(keys).__name__} and {type(values).__name__}"
        )
    if widths is None:
        widths = (int(body_lengths.max()), int(residual_lengths.max())) if body_lengths.numel() else (0, 0)
    block_d = head_block(D)
    block_n = PACKED_BLOCK_N
    sizing = (B * Hkv, block_n, query.device, split_size, slots)
    body_split, S_body = splits_for(widths[0], *sizing) if widths[0] else (block_n, 0)  # 0: no body
    rest_split, S_rest = splits_for(widths[1] + decode_length, *sizing)
    if not residual_keys.shape[0]:  # no residual row: a row to point at (never read, lengths are 0)
        residual_keys = residual_values = residual_keys.new_zeros(1, D)
    partials = Partials.empty(B * Hkv, S_body + S_rest, (H // Hkv) * q, D, query.device)
    options = launch_options(block_d, query.dtype)
    options["num_stages"] = min(options["num_stages"], STAGES)
    if query.dtype != torch.float32:
        options["num_warps"] = max(options["num_warps"], MIN_WARPS_16BIT)
    if S_body and uniform:  # a layer whose every entry is in the residual has no codes to read
        _launch_uniform(partials, S_body, body_split, query, keys, values, body_starts, body_lengths, scaling,
                        block_n, block_d, options)  # fmt: skip
    elif S_body:
        launch_rotated_partials(partials, S_body, body_split, query, keys, values, body_starts, body_lengths,
                                scaling, block_n, block_d, options)  # fmt: skip
    launch_ragged_partials(
        partials, S_body, S_rest, rest_split, query, residual_keys, residual_values, residual_starts,
        residual_lengths, decode_keys, decode_values, decode_length, scaling,
    )  # fmt: skip
    return combine(partials, query, Hkv)


def _launch_uniform(
    partials: Partials,
    splits: int,
    split_size: int,
    query: torch.Tensor,
    keys: UniformCodes,
    values: UniformCodes,
    body_starts: torch.Tensor,
    body_lengths: torch.Tensor,
    scaling: float,
    block_n: int,
    block_d: int,
    options: dict[str, int],
) -> None:
    """:func:`_packed_partial` over the body into splits ``0 .. splits - 1`` of ``partials``."""
    B, H, q, D = query.shape
    Hkv = body_starts.shape[1]
    G = H // Hkv
    if keys.bits != values.bits or keys.packed.stride(0) != values.packed.stride(0):
        raise ValueError("packed_decode_attention_triton: keys and values must share their bit width")
    k_rows, k_cols, k_stride = _groups(keys)
    v_rows, v_cols, v_stride = _groups(values)
    _packed_partial[check_grid((B * Hkv, splits))](
        query, keys.packed, keys.scale, keys.zero, values.packed, values.scale, values.zero,
        body_starts.contiguous(), body_lengths.contiguous(),
        partials.acc, partials.m, partials.l,
        scaling * LOG2E, split_size, partials.splits, q, Hkv, G,
        keys.bits, keys.packed.stride(0), k_rows, k_cols, k_stride, v_rows, v_cols, v_stride,
        *query.stride(),
        D=D, ROWS=pow2(G * q, 16), BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=dot_upcast(query.dtype),
        PRECISION=dot_precision(query.dtype), **options,
    )  # fmt: skip
