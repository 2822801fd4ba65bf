"""Triton decode attention over a channel-pruned layer: prompt keys with ``Dk`` of the ``D`` channels.

Launcher :func:`pruned_decode_attention_triton`: the attention
:func:`kvlab.cache.pruned.pruned_decode_attention` computes. A channel-pruned layer
(``model.compression.channels``, :mod:`kvlab.cache.pruned`) holds its prompt keys as ``[N, Dk]``
rows, each (sample, KV head) segment its own ``Dk`` channels, values as ``[N, D]`` and the decode
region with every channel. The caller gathers each query head's channels once, ``q_sel [B, H, q,
Dk]`` (:func:`kvlab.cache.pruned.query_channels`).

Split-K over two parts, one set of partials (:class:`~kvlab.kernels.tl.decode_attention.Partials`):

- :func:`_pruned_partial`, grid ``(B * Hkv, S_prompt)``: program ``(bh, s)`` loads the ``G * q``
  selected queries of KV head ``h`` once (``[ROWS, BLOCK_DK]``) and runs an online softmax over
  prompt rows ``[s * split, (s + 1) * split)`` of its segment: ``[BLOCK_N, BLOCK_DK]`` key tiles
  (only the kept channels are read) and ``[BLOCK_N, BLOCK_D]`` value tiles;
- the ragged decode kernel's partial program over the decode region alone, every channel of the
  whole query (:func:`~kvlab.kernels.tl.decode_attention.launch_ragged_partials` with empty prompt
  segments), in the splits after the prompt's;
- the decode kernel's combine, merging every split by log-sum-exp.

Logits are scaled by the layer's scaling (``1 / sqrt(D)``, not ``1 / sqrt(Dk)``). ``Dk`` is a
runtime argument (its tile ``BLOCK_DK`` and the value head dim ``D`` are compile-time), so one
compilation per dtype and tile serves every ``keep``.
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
    key_tile,
    launch_ragged_partials,
    softmax_step,
    splits_for,
    store_partial,
)


@triton.jit(do_not_specialize=["split", "n_splits", "Q", "HKV", "G", "DK"])
def _pruned_partial(
    q_ptr, pk_ptr, pv_ptr, starts_ptr, lengths_ptr,
    part_acc, part_m, part_l,
    scale_log2, split, n_splits, Q, HKV, G, DK,
    sq_b, sq_h, sq_q, sq_d, sk_n, sv_n,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # 64-bit: bh * stride passes 2**31 on long caches
    s = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, ROWS)  # row r: query head h * G + r // Q, step r % Q
    c = tl.arange(0, BLOCK_DK)
    c_ok = c < DK
    q_off = b * sq_b + (h * G + r // Q) * sq_h + (r % Q) * sq_q
    q = tl.load(
        q_ptr + q_off[:, None] + c[None, :] * sq_d, mask=(r < G * Q)[:, None] & c_ok[None, :], other=0.0
    )
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

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
        k = tl.load(pk_ptr + rows[:, None] * sk_n + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        p, alpha, m, lsum = softmax_step(q, k, ok[None, :], m, lsum, scale_log2, UPCAST, PRECISION)
        v = tl.load(pv_ptr + rows[:, None] * sv_n + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST, PRECISION)

    idx = (bh * n_splits + s) * (G * Q) + r
    store_partial(part_acc, part_m, part_l, idx, m, lsum, acc, r < G * Q, D, BLOCK_D)


LAUNCHED = (_pruned_partial,)


def pruned_decode_attention_triton(
    query: torch.Tensor,
    selected: torch.Tensor,
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
    """Attention of ``query [B, H, q, D]`` over a channel-pruned layer -> ``[B, H, q, D]`` (query dtype).

    Args:
        selected: ``[B, H, q, Dk]`` each query head's kept channels of its KV head (the prompt part's
            queries).
        prompt_keys: ``[N, Dk]`` the kept keys' channels; ``prompt_values`` ``[N, D]``; segments
            ``starts / lengths [B, Hkv]``.
        decode_keys / decode_values, decode_length, scaling, max_prompt_length: as
            :func:`~kvlab.kernels.decode_attention.ragged_decode_attention_reference`.
        split_size / slots: as :func:`~kvlab.kernels.tl.decode_attention.ragged_decode_attention_triton`,
            for the prompt's and the decode region's splits.
    """
    B, H, q, D = query.shape
    Hkv, Dk = starts.shape[1], prompt_keys.shape[1]
    G = H // Hkv
    if max_prompt_length is None:
        max_prompt_length = int(lengths.max()) if lengths.numel() else 0
    block_d, block_dk = head_block(D), head_block(Dk)
    block_n = key_tile(block_d)
    sizing = (B * Hkv, block_n, query.device, split_size, slots)
    prompt_split, S_prompt = splits_for(max_prompt_length, *sizing) if max_prompt_length else (block_n, 0)
    decode_split, S_decode = splits_for(decode_length, *sizing)
    partials = Partials.empty(B * Hkv, S_prompt + S_decode, G * q, D, query.device)
    prompt_keys, prompt_values = prompt_keys.contiguous(), prompt_values.contiguous()
    if S_prompt:
        _pruned_partial[check_grid((B * Hkv, S_prompt))](
            selected, prompt_keys, prompt_values, starts.contiguous(), lengths.contiguous(),
            partials.acc, partials.m, partials.l,
            scaling * LOG2E, prompt_split, partials.splits, q, Hkv, G, Dk,
            *selected.stride(), prompt_keys.stride(0), prompt_values.stride(0),
            D=D, ROWS=pow2(G * q, 16), BLOCK_N=block_n, BLOCK_DK=block_dk, BLOCK_D=block_d,
            UPCAST=dot_upcast(query.dtype), PRECISION=dot_precision(query.dtype),
            **launch_options(block_d, query.dtype),
        )  # fmt: skip
    empty = torch.zeros_like(lengths)  # the decode region alone: no prompt row (one to point at)
    none = prompt_values.new_zeros(1, D)
    launch_ragged_partials(
        partials, S_prompt, S_decode, decode_split, query, none, none, empty, empty,
        decode_keys, decode_values, decode_length, scaling,
    )  # fmt: skip
    return combine(partials, query, Hkv)
