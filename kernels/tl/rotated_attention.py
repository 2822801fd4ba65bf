"""Triton decode attention over TurboQuant codes, in the rotated basis, without dequantizing them.

The body program of :func:`kvlab.kernels.tl.packed_attention.packed_decode_attention_triton` for
:class:`~kvlab.kernels.types.RotatedCodebookCodes` (TurboQuant, Zandieh et al. 2025, Algorithms
1-2). A key is stored as ``x^ = ||x|| (Π^T c[idx] + γ sqrt(π/2) / D  S^T z)`` (``c`` the Lloyd-Max
codebook, ``z = sign(S r)`` the QJL sketch of the unit residual, ``γ = ||r||``), a value as
``||x|| Π^T c[idx]``. Both are linear in what the kernel reads, so with the query rotated once,
``q' = Π q`` and ``q_s = S q`` (two ``[D, D]`` products per call, in torch):

- logit of key ``j``: ``<q, x^_j> = ||x_j|| (<q', c[idx_j]> + γ_j sqrt(π/2) / D <q_s, z_j>)``: per
  ``[BLOCK_N, BLOCK_D]`` tile the indices are unpacked from their bytes, looked up in the codebook
  (``2^b`` fp32 entries, a gather from a few cached bytes) and fed to ``tl.dot`` with ``q'``; the
  signs, unpacked as ``±1``, to a second ``tl.dot`` with ``q_s``; each column is then scaled by its
  row's norm and ``γ``. This is the estimator
  :meth:`~kvlab.compression.turboquant.RotatedCodes.dequantize_rows` builds, term for term
  (Theorem 2's unbiased inner product), with the rotation moved to the query;
- values: ``sum_j p_j ||x_j|| Π^T c[idx_j] = Π^T sum_j p_j ||x_j|| c[idx_j]``: the program
  accumulates ``p (||x|| c[idx])`` in the rotated basis and the launcher rotates each body split's
  accumulator back once (``acc Π``, in torch) before the log-sum-exp combine, which is linear in
  the accumulators: exact up to rounding.

No dequantized entry is written to memory. In 16 bits the ``tl.dot`` operands are ``q'``, ``q_s``
and the looked-up centroids (times the value norms) rounded to the entries' dtype, as the torch path
rounds the dequantized entries; logits, softmax and accumulation are fp32. Index layout (that of
:func:`kvlab.compression.quantizers.pack_codes`): for ``b`` in {1, 2, 4}, code ``d`` in bits
``d b .. d b + b - 1`` of its row (``8 / b`` per byte, the first in the low bits); for 3 bits, ``b``
one-bit planes (bit ``j`` of code ``d`` at bit ``j D + d``). The keys' and values' widths
(``K_BITS``, ``V_BITS``: a quantizer's setting, so one compilation per setting) are compile-time
constants, so each unpacking is unrolled: with the widths as runtime arguments and a runtime loop
over planes, sm_80 and sm_90 spilled 8-16 bytes a thread at head dims 8-32 in fp32; unrolled, none
(``tests/kernels/test_kernel_compile.py``). ``K_BITS = 0`` (TurboQuant at 1 bit: keys are the
sketch alone) skips the codebook term.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import dot_upcast
from kvlab.kernels.tl.common import EMPTY, LOG2E, check_grid, dot, dot_precision, pow2
from kvlab.kernels.tl.decode_attention import Partials, load_queries, online_softmax, store_partial
from kvlab.kernels.types import RotatedCodebookCodes


@triton.jit
def _indices(codes_ptr, rows, mask, d, stride, BITS: tl.constexpr, D: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` int32 ``BITS``-bit codes of channels ``d`` of body rows ``rows`` (zero
    where not ``mask``), in :func:`~kvlab.compression.quantizers.pack_codes`' layout (the module
    docstring)."""
    if 8 % BITS == 0:  # one field of BITS bits: bit d BITS of the row
        byte = tl.load(codes_ptr + rows[:, None] * stride + (d * BITS // 8)[None, :], mask=mask, other=0)
        idx = (byte.to(tl.int32) >> ((d * BITS) % 8)[None, :]) & ((1 << BITS) - 1)
    else:  # BITS one-bit planes: bit j of code d at bit j D + d of the row
        idx = tl.zeros_like(mask.to(tl.int32))
        for j in tl.static_range(BITS):
            byte = tl.load(
                codes_ptr + rows[:, None] * stride + ((j * D + d) // 8)[None, :], mask=mask, other=0
            )
            idx = idx | (((byte.to(tl.int32) >> ((j * D + d) % 8)[None, :]) & 1) << j)
    return idx


@triton.jit(do_not_specialize=["split", "n_splits", "Q", "HKV", "G", "k_stride", "s_stride", "v_stride"])
def _rotated_partial(
    qr_ptr, qs_ptr, kc_ptr, kb_ptr, kn_ptr, ks_ptr, kg_ptr, vc_ptr, vb_ptr, vn_ptr, starts_ptr, lengths_ptr,
    part_acc, part_m, part_l,
    scale_log2, qjl, split, n_splits, Q, HKV, G,
    k_stride, s_stride, v_stride,
    sq_b, sq_h, sq_q, sq_d,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, SKETCH: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    q, _ = load_queries(qr_ptr, bh, HKV, G, Q, sq_b, sq_h, sq_q, sq_d, D, ROWS, BLOCK_D)  # Π q
    if SKETCH:
        q_s, _ = load_queries(qs_ptr, bh, HKV, G, Q, sq_b, sq_h, sq_q, sq_d, D, ROWS, BLOCK_D)  # S q
    else:
        q_s = q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    start = tl.load(starts_ptr + bh).to(tl.int64)
    length = tl.load(lengths_ptr + bh).to(tl.int32)
    lo = s * split
    hi = tl.minimum(lo + split, length)

    m = tl.full([ROWS], EMPTY, tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)  # in the rotated basis
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < hi
        rows = start + pos
        mask = ok[:, None] & d_ok[None, :]
        if K_BITS > 0:
            idx = _indices(kc_ptr, rows, mask, d, k_stride, K_BITS, D)
            centroids = tl.load(kb_ptr + idx, mask=mask, other=0.0).to(q.dtype)
            logits = dot(q, tl.trans(centroids), UPCAST, PRECISION)  # <Π q, c[idx]>
        else:  # keys of the sketch alone
            logits = tl.zeros([ROWS, BLOCK_N], tl.float32)
        if SKETCH:
            # ±1 through fp32: the interpreter converts integers to bf16 wrongly (raw bits)
            signs = tl.where(_indices(ks_ptr, rows, mask, d, s_stride, 1, D) != 0, 1.0, -1.0).to(q.dtype)
            gamma = tl.load(kg_ptr + rows, mask=ok, other=0.0).to(tl.float32)
            logits += dot(q_s, tl.trans(signs), UPCAST, PRECISION) * (gamma * qjl)[None, :]
        norm = tl.load(kn_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        p, alpha, m, lsum = online_softmax(logits * (norm * scale_log2)[None, :], ok[None, :], m, lsum)
        idx = _indices(vc_ptr, rows, mask, d, v_stride, V_BITS, D)
        v_norm = tl.load(vn_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        v = (tl.load(vb_ptr + idx, mask=mask, other=0.0) * v_norm[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, UPCAST, PRECISION)

    r = tl.arange(0, ROWS)
    idx = (bh * n_splits + s) * (G * Q) + r
    store_partial(part_acc, part_m, part_l, idx, m, lsum, acc, r < G * Q, D, BLOCK_D)


LAUNCHED = (_rotated_partial,)


def rotate(query: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``query [..., D]`` times ``matrix^T [D, D]`` (``Π q``, ``S q``) in fp32, in the query dtype
    (torch's fp32 product: TF32 only where the process allows it,
    ``torch.backends.cuda.matmul.allow_tf32``, as for the rotation back)."""
    return torch.matmul(query.float(), matrix.T).to(query.dtype)


def launch_rotated_partials(
    partials: Partials,
    splits: int,
    split_size: int,
    query: torch.Tensor,
    keys: RotatedCodebookCodes,
    values: RotatedCodebookCodes,
    body_starts: torch.Tensor,
    body_lengths: torch.Tensor,
    scaling: float,
    block_n: int,
    block_d: int,
    options: dict[str, int],
) -> None:
    """:func:`_rotated_partial` over the body (arguments of
    :func:`~kvlab.kernels.tl.packed_attention.packed_decode_attention_triton`) into splits
    ``0 .. splits - 1`` of ``partials``, their accumulators then rotated back (``acc Π``)."""
    B, H, q, D = query.shape
    Hkv = body_starts.shape[1]
    if values.signs is not None:
        raise ValueError(
            "packed_decode_attention_triton: TurboQuant values carry no QJL sketch (TurboQuant_mse, "
            "Algorithm 1); these do, and their S^T sign term has no rotated-basis accumulator"
        )
    if keys.dim != D or values.dim != D:
        raise ValueError(f"packed_decode_attention_triton: codes of head dim {keys.dim} for queries of {D}")
    rotated = rotate(query, keys.rotation)
    sketched = rotate(query, keys.projection) if keys.signs is not None else rotated
    # what a code has not (no codebook bits, no sketch) its constexpr switch never reads: the
    # norms stand in for the pointer
    k_codes, signs, gamma = (t if t is not None else keys.norm for t in (keys.packed, keys.signs, keys.gamma))
    v_codes = values.packed if values.packed is not None else values.norm
    _rotated_partial[check_grid((B * Hkv, splits))](
        rotated, sketched, k_codes, keys.codebook, keys.norm, signs, gamma,
        v_codes, values.codebook, values.norm, body_starts.contiguous(), body_lengths.contiguous(),
        partials.acc, partials.m, partials.l,
        scaling * LOG2E, math.sqrt(math.pi / 2) / D, split_size, partials.splits, q, Hkv, H // Hkv,
        k_codes.stride(0), signs.stride(0), v_codes.stride(0),
        *rotated.stride(),
        D=D, ROWS=pow2((H // Hkv) * q, 16), BLOCK_N=block_n, BLOCK_D=block_d,
        K_BITS=keys.mse_bits, V_BITS=values.mse_bits, SKETCH=keys.signs is not None,
        UPCAST=dot_upcast(query.dtype), PRECISION=dot_precision(query.dtype), **options,
    )  # fmt: skip
    body = partials.acc.view(B * Hkv, partials.splits, -1, D)[:, :splits]
    body.copy_(torch.matmul(body, values.rotation))  # Π^T acc, row by row
