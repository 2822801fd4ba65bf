"""Triton ragged decode attention (split-K flash decoding over the flat kept-token layout).

Launcher :func:`ragged_decode_attention_triton` has the signature of
:func:`kvlab.kernels.decode_attention.ragged_decode_attention_reference`.

Grid of the first kernel: ``(B * Hkv, S)``. Program ``(b*Hkv + h, s)`` loads the ``G*q`` queries
of KV head ``h`` once (GQA: every K/V tile is read once per KV head, not once per query head)
and runs an online softmax over tokens ``[s*split, (s+1)*split)`` of that head's sequence
(kept prompt tokens, then the decode tokens), writing a partial ``(max, sum, acc)``. The number
of splits ``S`` is sized from the longest head so that ``B * Hkv * S`` fills the device: one
long head does not serialise the batch, and a head shorter than ``s*split`` exits at once.
The second kernel, one program per query row, merges the ``S`` partials ``BLOCK_S`` at a time
(log-sum-exp weights) and writes the output in the query dtype. Logits, softmax statistics and
accumulators are fp32.

Only the head dim ``D`` and the tile sizes are compile-time constants: the split count, split
size, decode length, chunk length ``q``, batch size and even the head counts are runtime
arguments, so a generation compiles each kernel once per dtype and head dim.
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
    parallel_slots,
    pow2,
    split_size_for,
)

BLOCK_N = 64  # tokens per K/V tile (half that for head dims over 128: see key_tile)
MIN_SPLIT = 256  # fewest tokens per split
BLOCK_S = 16  # partials merged per step of the combine kernel


@triton.jit
def _load_kv(
    prompt_ptr, decode_ptr, rows, dec_idx, in_prompt, in_dec, d, d_ok, sp_n, sd_c, sd_d, BLOCK_D: tl.constexpr
):
    """A ``[BLOCK_N, BLOCK_D]`` tile: prompt rows where ``in_prompt``, decode slots where ``in_dec``."""
    from_prompt = tl.load(
        prompt_ptr + rows[:, None] * sp_n + d[None, :], mask=in_prompt[:, None] & d_ok[None, :], other=0.0
    )
    from_decode = tl.load(
        decode_ptr + dec_idx[:, None] * sd_c + d[None, :] * sd_d,
        mask=in_dec[:, None] & d_ok[None, :],
        other=0.0,
    )
    return tl.where(in_prompt[:, None], from_prompt, from_decode)


@triton.jit(do_not_specialize=["decode_length", "split", "n_splits", "Q", "HKV", "G"])
def _decode_partial(
    q_ptr, pk_ptr, pv_ptr, starts_ptr, lengths_ptr, dk_ptr, dv_ptr,
    part_acc, part_m, part_l,
    decode_length, scale_log2, split, n_splits, Q, HKV, G,
    sq_b, sq_h, sq_q, sq_d,
    sp_n,
    sd_b, sd_h, sd_c, sd_d,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh * stride passes 2**31 on long caches
    s = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, ROWS)
    g = r // Q
    i = r % Q
    row_ok = r < G * Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q_off = b * sq_b + (h * G + g) * sq_h + i * sq_q
    q = tl.load(q_ptr + q_off[:, None] + d[None, :] * sq_d, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    start = tl.load(starts_ptr + bh).to(tl.int64)
    plen = tl.load(lengths_ptr + bh).to(tl.int32)
    total = plen + decode_length
    lo = s * split
    hi = tl.minimum(lo + split, total)
    last_visible = decode_length - Q + i  # decode slot limit of each query row (causal)

    m = tl.full([ROWS], EMPTY, tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    dk_base = dk_ptr + b * sd_b + h * sd_h
    dv_base = dv_ptr + b * sd_b + h * sd_h
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_prompt = pos < plen
        in_dec = (pos >= plen) & (pos < hi)
        rows = start + pos
        dec_idx = pos - plen
        k = _load_kv(pk_ptr, dk_base, rows, dec_idx, in_prompt, in_dec, d, d_ok, sp_n, sd_c, sd_d, BLOCK_D)
        logits = dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2  # [ROWS, BLOCK_N], log2 domain
        visible = in_prompt[None, :] | (in_dec[None, :] & (dec_idx[None, :] <= last_visible[:, None]))
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(logits - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        v = _load_kv(pv_ptr, dv_base, rows, dec_idx, in_prompt, in_dec, d, d_ok, sp_n, sd_c, sd_d, BLOCK_D)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m = m_new

    out = (bh * n_splits + s) * (G * Q) + r
    tl.store(part_m + out, m, mask=row_ok)
    tl.store(part_l + out, lsum, mask=row_ok)
    tl.store(part_acc + out[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["n_splits", "Q", "HKV", "G"])
def _decode_combine(
    part_acc, part_m, part_l, out_ptr, n_splits, Q, HKV, G,
    so_b, so_h, so_q, so_d,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (b * HKV + h) * G*Q + r
    bh = row // (G * Q)
    r = row % (G * Q)
    b = bh // HKV
    head = (bh % HKV) * G + r // Q
    i = r % Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = tl.full([], EMPTY, tl.float32)
    lsum = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):  # bounded tiles however many splits there are
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < n_splits
        idx = (bh * n_splits + s) * (G * Q) + r
        m_s = tl.load(part_m + idx, mask=s_ok, other=EMPTY)
        l_s = tl.load(part_l + idx, mask=s_ok, other=0.0)
        acc_s = tl.load(
            part_acc + idx[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        m_new = tl.maximum(m, tl.max(m_s, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(m_s - m_new)
        lsum = lsum * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * acc_s, 0)
        m = m_new
    o = acc / tl.where(lsum > 0, lsum, 1.0)
    ptr = out_ptr + b * so_b + head * so_h + i * so_q + d * so_d
    tl.store(ptr, o.to(out_ptr.dtype.element_ty), mask=d_ok)


LAUNCHED = (_decode_partial, _decode_combine)


def key_tile(block_d: int) -> int:
    """Tokens per K/V tile for a head tile of ``block_d``: :data:`BLOCK_N`, halved above 128.

    The software pipeline holds ``num_stages`` K and V tiles in shared memory; at a 256-wide head
    a 64-token tile asked for 305,152 bytes in 16-bit (sm_80 gives a block 163 KiB, sm_90
    227 KiB: the launch failed on an H100), so wide heads take 32-token tiles.
    """
    return BLOCK_N if block_d <= 128 else BLOCK_N // 2


def ragged_decode_attention_triton(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    split_size: int | None = None,
    slots: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.decode_attention.ragged_decode_attention_reference`.

    ``split_size`` (tokens per split, rounded up to the key tile, :func:`key_tile`) overrides the automatic
    split-K sizing; ``slots`` (default :func:`~kvlab.kernels.tl.common.parallel_slots` of the
    device) is what the automatic sizing fills, so a test can size splits as a GPU would.
    """
    B, H, q, D = query.shape
    Hkv = starts.shape[1]
    G = H // Hkv
    if max_prompt_length is None:
        max_prompt_length = int(lengths.max()) if lengths.numel() else 0
    longest = max_prompt_length + decode_length
    block_d = head_block(D)
    block_n = key_tile(block_d)
    if split_size is None:
        slots = slots if slots is not None else parallel_slots(query.device)
        split_size, S = split_size_for(longest, B * Hkv, slots, MIN_SPLIT, block_n)
    else:
        split_size = -(-split_size // block_n) * block_n
        S = max(1, -(-longest // split_size))
    rows = G * q
    dev = query.device
    part_acc = torch.empty(B * Hkv * S * rows, D, device=dev, dtype=torch.float32)
    part_m = torch.empty(B * Hkv * S * rows, device=dev, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    out = torch.empty(B, H, q, D, device=dev, dtype=query.dtype)
    prompt_keys = prompt_keys.contiguous()
    prompt_values = prompt_values.contiguous()
    starts, lengths = starts.contiguous(), lengths.contiguous()
    if decode_values.stride() != decode_keys.stride():
        decode_values = decode_values.contiguous()
        decode_keys = decode_keys.contiguous()
    shape = dict(D=D, BLOCK_D=block_d, **launch_options(block_d, query.dtype))
    _decode_partial[check_grid((B * Hkv, S))](
        query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values,
        part_acc, part_m, part_l,
        decode_length, scaling * LOG2E, split_size, S, q, Hkv, G,
        *query.stride(), prompt_keys.stride(0), *decode_keys.stride(),
        ROWS=pow2(rows, 16), BLOCK_N=block_n, UPCAST=dot_upcast(query.dtype),
        PRECISION=dot_precision(query.dtype), **shape,
    )  # fmt: skip
    _decode_combine[check_grid((B * Hkv * rows,))](
        part_acc, part_m, part_l, out, S, q, Hkv, G, *out.stride(), BLOCK_S=BLOCK_S, **shape,
    )  # fmt: skip
    return out
