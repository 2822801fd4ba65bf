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

from dataclasses import dataclass

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


@triton.jit
def load_queries(
    q_ptr, bh, HKV, G, Q, sq_b, sq_h, sq_q, sq_d, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The ``G * Q`` queries of KV head ``bh`` (flat ``b * HKV + h``) as a ``[ROWS, BLOCK_D]`` tile
    (row ``r``: query head ``h * G + r // Q``, step ``r % Q``; zero past ``G * Q`` and ``D``), and
    each row's step ``r % Q`` ``[ROWS]``."""
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, ROWS)
    i = r % Q
    d = tl.arange(0, BLOCK_D)
    q_off = b * sq_b + (h * G + r // Q) * sq_h + i * sq_q
    mask = (r < G * Q)[:, None] & (d < D)[None, :]
    return tl.load(q_ptr + q_off[:, None] + d[None, :] * sq_d, mask=mask, other=0.0), i


@triton.jit
def softmax_step(q, k, visible, m, lsum, scale_log2, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile ``k [BLOCK_N, BLOCK_D]`` of an online softmax (log2 domain, fp32): ``visible``
    ``[ROWS, BLOCK_N]`` (or broadcastable) masks logits; returns the tile's unnormalised
    probabilities ``p``, the rescale ``alpha`` of the earlier sums and the new max and sum."""
    return online_softmax(dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2, visible, m, lsum)


@triton.jit
def online_softmax(logits, visible, m, lsum):
    """:func:`softmax_step` from a tile's logits ``[ROWS, BLOCK_N]`` (fp32, log2 domain, scaled),
    for kernels that do not compute them as one ``q k^T``."""
    logits = tl.where(visible, logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(logits - m_new[:, None])
    return p, alpha, m_new, lsum * alpha + tl.sum(p, 1)


@triton.jit
def store_partial(
    part_acc, part_m, part_l, idx, m, lsum, acc, rows_ok, D: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Write one split's ``(max, sum, acc)`` of query rows ``idx [ROWS]`` (where ``rows_ok``)."""
    d = tl.arange(0, BLOCK_D)
    tl.store(part_m + idx, m, mask=rows_ok)
    tl.store(part_l + idx, lsum, mask=rows_ok)
    tl.store(part_acc + idx[:, None] * D + d[None, :], acc, mask=rows_ok[:, None] & (d < D)[None, :])


@triton.jit(do_not_specialize=["decode_length", "split", "n_splits", "first_split", "Q", "HKV", "G"])
def _decode_partial(
    q_ptr, pk_ptr, pv_ptr, starts_ptr, lengths_ptr, dk_ptr, dv_ptr,
    part_acc, part_m, part_l,
    decode_length, scale_log2, split, n_splits, first_split, Q, HKV, G,
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
    q, i = load_queries(q_ptr, bh, HKV, G, Q, sq_b, sq_h, sq_q, sq_d, D, ROWS, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

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
        visible = in_prompt[None, :] | (in_dec[None, :] & (dec_idx[None, :] <= last_visible[:, None]))
        p, alpha, m, lsum = softmax_step(q, k, visible, m, lsum, scale_log2, UPCAST, PRECISION)
        v = _load_kv(pv_ptr, dv_base, rows, dec_idx, in_prompt, in_dec, d, d_ok, sp_n, sd_c, sd_d, BLOCK_D)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, PRECISION)

    r = tl.arange(0, ROWS)
    idx = (bh * n_splits + first_split + s) * (G * Q) + r
    store_partial(part_acc, part_m, part_l, idx, m, lsum, acc, r < G * Q, D, BLOCK_D)


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


@dataclass
class Partials:
    """Split-K partials of ``n`` KV heads x ``splits`` splits x ``rows`` query rows, fp32:
    ``acc [n * splits * rows, D]``, running max ``m`` and sum ``l`` ``[n * splits * rows]``; row
    ``(head * splits + split) * rows + r``. Kernels write disjoint ranges of splits (the packed
    decode kernel the body's first, :mod:`kvlab.kernels.tl.packed_attention`); :func:`combine`
    merges them all."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the softmax sum, as in the papers)
    splits: int

    @classmethod
    def empty(cls, heads: int, splits: int, rows: int, D: int, device: torch.device) -> Partials:
        m = torch.empty(heads * splits * rows, device=device, dtype=torch.float32)
        acc = torch.empty(heads * splits * rows, D, device=device, dtype=torch.float32)
        return cls(acc, m, torch.empty_like(m), splits)


def splits_for(
    longest: int, heads: int, block_n: int, device: torch.device, split_size: int | None, slots: int | None
) -> tuple[int, int]:
    """``(tokens per split, splits)`` over ``longest`` tokens: ``split_size`` rounded up to the key
    tile, or sized to fill ``slots`` (default :func:`~kvlab.kernels.tl.common.parallel_slots`)."""
    if split_size is None:
        slots = slots if slots is not None else parallel_slots(device)
        return split_size_for(longest, heads, slots, MIN_SPLIT, block_n)
    split_size = -(-split_size // block_n) * block_n
    return split_size, max(1, -(-longest // split_size))


def launch_ragged_partials(
    partials: Partials,
    first_split: int,
    splits: int,
    split_size: int,
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
) -> None:
    """:func:`_decode_partial` over the flat entries and the decode region (arguments of
    :func:`ragged_decode_attention_triton`), into splits ``first_split .. first_split + splits - 1``
    of ``partials``."""
    B, H, q, D = query.shape
    Hkv = starts.shape[1]
    block_d = head_block(D)
    prompt_keys, prompt_values = prompt_keys.contiguous(), prompt_values.contiguous()
    starts, lengths = starts.contiguous(), lengths.contiguous()
    if decode_values.stride() != decode_keys.stride():
        decode_values, decode_keys = decode_values.contiguous(), decode_keys.contiguous()
    _decode_partial[check_grid((B * Hkv, splits))](
        query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values,
        partials.acc, partials.m, partials.l,
        decode_length, scaling * LOG2E, split_size, partials.splits, first_split, q, Hkv, H // Hkv,
        *query.stride(), prompt_keys.stride(0), *decode_keys.stride(),
        D=D, ROWS=pow2((H // Hkv) * q, 16), BLOCK_N=key_tile(block_d), BLOCK_D=block_d,
        UPCAST=dot_upcast(query.dtype), PRECISION=dot_precision(query.dtype),
        **launch_options(block_d, query.dtype),
    )  # fmt: skip


def combine(partials: Partials, query: torch.Tensor, Hkv: int) -> torch.Tensor:
    """``[B, H, q, D]`` in the query dtype: every split of ``partials`` merged (:func:`_decode_combine`)."""
    B, H, q, D = query.shape
    block_d = head_block(D)
    out = torch.empty(B, H, q, D, device=query.device, dtype=query.dtype)
    _decode_combine[check_grid((B * H * q,))](
        partials.acc, partials.m, partials.l, out, partials.splits, q, Hkv, H // Hkv, *out.stride(),
        D=D, BLOCK_S=BLOCK_S, BLOCK_D=block_d, **launch_options(block_d, query.dtype),
    )  # fmt: skip
    return out


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
    if max_prompt_length is None:
        max_prompt_length = int(lengths.max()) if lengths.numel() else 0
    block_n = key_tile(head_block(D))
    split_size, S = splits_for(
        max_prompt_length + decode_length, B * Hkv, block_n, query.device, split_size, slots
    )
    partials = Partials.empty(B * Hkv, S, (H // Hkv) * q, D, query.device)
    launch_ragged_partials(
        partials, 0, S, split_size, query, prompt_keys, prompt_values, starts, lengths,
        decode_keys, decode_values, decode_length, scaling,
    )  # fmt: skip
    return combine(partials, query, Hkv)
