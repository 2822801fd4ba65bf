"""Triton window-attention scores: two passes over the keys, never the ``[B, H, W, T]`` probabilities.

Rows of one program are a tile of ``BLOCK_G`` query heads of one KV group times ``BLOCK_W``
window queries (<= 128 rows, >= 16 for ``tl.dot``), so every key tile is loaded once for the
whole tile (GQA aware).

1. ``_row_stats``, grid ``(B * Hkv * tiles, S)``: online-softmax maximum and sum of exponentials
   of every window row over keys ``[s*split, (s+1)*split)`` (split-K, so a long prompt with few
   heads still fills the device); partials ``[S, B*H*W]`` fp32.
2. ``_column_sums``, grid ``(B * Hkv * tiles * ceil(T / BLOCK_T),)`` (one dimension: at 4M
   tokens the key tiles alone pass the 65535 limit of grid dimensions 1 and 2): merge the row
   statistics ``BLOCK_S`` splits at a time, recompute the logits of one key tile, normalise,
   mask, and sum over the tile's window rows per query head into ``[chunks, B, H, T]``
   (``chunks = ceil(W / 128)``, summed in torch).

Compile-time constants are the head dim ``D`` and the tile sizes (the row tile follows from
the window and group size); the prompt length ``T``, the window ``W``, the split count, the
head counts and the batch size are runtime arguments, so a new prompt length does not compile
the kernels again.

Extra memory: ``O(S * H * W + H * T)`` fp32 instead of ``B * H * W * T`` fp32 several times over.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import dot_upcast
from kvlab.kernels.tl.common import (
    EMPTY,
    LOG2E,
    MIN_DOT,
    check_grid,
    dot,
    dot_precision,
    head_block,
    launch_options,
    parallel_slots,
    pow2,
    split_size_for,
)

MAX_ROWS = 128  # window rows of one program
BLOCK_T = 64  # keys per tile
MIN_SPLIT = 1024  # fewest keys per split of the statistics pass
BLOCK_S = 16  # statistics partials merged per step


@triton.jit
def _tile_rows(
    q_ptr, valid_ptr, tile, T, W, n_tiles, n_wchunks, HKV, G, sq_b, sq_h, sq_w, sq_d,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Indices of row tile ``tile`` (int64): sample, KV head, query heads, queries, row masks."""
    bh = tile // n_tiles
    t = tile % n_tiles
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, BLOCK_G * BLOCK_W)
    g = (t // n_wchunks) * BLOCK_G + r // BLOCK_W
    i = (t % n_wchunks) * BLOCK_W + r % BLOCK_W
    row_ok = (g < G) & (i < W)
    query_pos = T - W + i
    row_ok = row_ok & (tl.load(valid_ptr + b * T + query_pos, mask=row_ok, other=0) != 0)
    d = tl.arange(0, BLOCK_D)
    q_off = b * sq_b + (h * G + g) * sq_h + i * sq_w
    q = tl.load(
        q_ptr + q_off[:, None] + d[None, :] * sq_d, mask=row_ok[:, None] & (d < D)[None, :], other=0.0
    )
    stat_row = (b * (HKV * G) + h * G + g) * W + i
    return b, h, q, query_pos, row_ok, stat_row


@triton.jit
def _logits(
    q, k_ptr, valid_ptr, b, h, n0, T, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Masked log2-domain logits ``[rows, BLOCK_T]`` of a row tile against keys ``n0 ..``."""
    t = n0 + tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, BLOCK_D)
    k = tl.load(
        k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :] * sk_d,
        mask=t_ok[:, None] & (d < D)[None, :],
        other=0.0,
    )
    key_ok = t_ok & (tl.load(valid_ptr + b * T + t, mask=t_ok, other=0) != 0)
    visible = row_ok[:, None] & key_ok[None, :] & (t[None, :] <= query_pos[:, None])
    return tl.where(visible, dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2, float("-inf")), visible


@triton.jit(do_not_specialize=["split", "total_rows", "T", "W", "n_tiles", "n_wchunks", "HKV", "G"])
def _row_stats(
    q_ptr, k_ptr, valid_ptr, part_m, part_l, scale_log2, split, total_rows, T, W, n_tiles, n_wchunks,
    HKV, G, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_t, sk_d,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b, h, q, query_pos, row_ok, stat_row = _tile_rows(
        q_ptr, valid_ptr, tl.program_id(0).to(tl.int64), T, W, n_tiles, n_wchunks, HKV, G,
        sq_b, sq_h, sq_w, sq_d, D, BLOCK_G, BLOCK_W, BLOCK_D,
    )  # fmt: skip
    s = tl.program_id(1).to(tl.int64)
    m = tl.full([BLOCK_G * BLOCK_W], EMPTY, tl.float32)
    lsum = tl.zeros([BLOCK_G * BLOCK_W], tl.float32)
    for n0 in range(s * split, tl.minimum(s * split + split, T), BLOCK_T):
        logits, _ = _logits(
            q, k_ptr, valid_ptr, b, h, n0, T, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
            D, BLOCK_T, BLOCK_D, UPCAST, PRECISION,
        )  # fmt: skip
        m_new = tl.maximum(m, tl.max(logits, 1))
        lsum = lsum * tl.exp2(m - m_new) + tl.sum(tl.exp2(logits - m_new[:, None]), 1)
        m = m_new
    tl.store(part_m + s * total_rows + stat_row, m, mask=row_ok)
    tl.store(part_l + s * total_rows + stat_row, lsum, mask=row_ok)


@triton.jit(
    do_not_specialize=["total_rows", "T", "W", "n_tiles", "n_wchunks", "HKV", "G", "n_splits", "n_key_tiles"]
)
def _column_sums(
    q_ptr, k_ptr, valid_ptr, part_m, part_l, out_ptr, scale_log2, total_rows, T, W, n_tiles, n_wchunks,
    HKV, G, n_splits, n_key_tiles, sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_t, sk_d,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    tile = pid // n_key_tiles
    b, h, q, query_pos, row_ok, stat_row = _tile_rows(
        q_ptr, valid_ptr, tile, T, W, n_tiles, n_wchunks, HKV, G, sq_b, sq_h, sq_w, sq_d,
        D, BLOCK_G, BLOCK_W, BLOCK_D,
    )  # fmt: skip
    m = tl.full([BLOCK_G * BLOCK_W], EMPTY, tl.float32)
    lsum = tl.zeros([BLOCK_G * BLOCK_W], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):  # bounded tiles however many splits there are
        s = s0 + tl.arange(0, BLOCK_S)
        idx = s[:, None] * total_rows + stat_row[None, :]
        ok = (s < n_splits)[:, None] & row_ok[None, :]
        m_parts = tl.load(part_m + idx, mask=ok, other=EMPTY)
        l_parts = tl.load(part_l + idx, mask=ok, other=0.0)
        m_new = tl.maximum(m, tl.max(m_parts, 0))
        lsum = lsum * tl.exp2(m - m_new) + tl.sum(l_parts * tl.exp2(m_parts - m_new[None, :]), 0)
        m = m_new
    inv_l = tl.where(row_ok & (lsum > 0), 1.0 / tl.where(lsum > 0, lsum, 1.0), 0.0)

    n0 = (pid % n_key_tiles) * BLOCK_T
    logits, visible = _logits(
        q, k_ptr, valid_ptr, b, h, n0, T, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
        D, BLOCK_T, BLOCK_D, UPCAST, PRECISION,
    )  # fmt: skip
    probs = tl.where(visible, tl.exp2(logits - m[:, None]) * inv_l[:, None], 0.0)
    per_head = tl.sum(tl.reshape(probs, [BLOCK_G, BLOCK_W, BLOCK_T]), 1)  # [BLOCK_G, BLOCK_T]

    t = n0 + tl.arange(0, BLOCK_T)
    head_g = ((tile % n_tiles) // n_wchunks) * BLOCK_G + tl.arange(0, BLOCK_G)
    chunk = (tile % n_tiles) % n_wchunks
    rows = ((chunk * (total_rows // W)) + b * (HKV * G) + h * G + head_g) * T
    tl.store(out_ptr + rows[:, None] + t[None, :], per_head, mask=(head_g < G)[:, None] & (t < T)[None, :])


LAUNCHED = (_row_stats, _column_sums)


def row_tile(window: int, group: int) -> tuple[int, int]:
    """``(BLOCK_G, BLOCK_W)``: query heads x window rows of a program's row tile (16 to 128 rows)."""
    block_w = min(pow2(window), MAX_ROWS)
    block_g = min(pow2(group), max(1, MAX_ROWS // block_w))
    if block_g * block_w < MIN_DOT:  # tl.dot needs 16 rows: pad with empty window rows
        block_w = MIN_DOT // block_g
    return block_g, block_w


def window_attention_scores_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    split_size: int | None = None,
    slots: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.window_scores.window_attention_scores_reference`.

    ``split_size`` (keys per split of the statistics pass) overrides the automatic sizing;
    ``slots`` (default :func:`~kvlab.kernels.tl.common.parallel_slots` of the device) is what
    the automatic sizing fills, so a test can size splits as a GPU would.
    """
    B, H, W, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = H // Hkv
    block_g, block_w = row_tile(W, G)
    n_wchunks = triton.cdiv(W, block_w)
    n_tiles = triton.cdiv(G, block_g) * n_wchunks
    if split_size is None:
        slots = slots if slots is not None else parallel_slots(keys.device)
        split_size, S = split_size_for(T, B * Hkv * n_tiles, slots, MIN_SPLIT, BLOCK_T)
    else:
        split_size = -(-split_size // BLOCK_T) * BLOCK_T
        S = triton.cdiv(T, split_size)
    total_rows = B * H * W
    part_m = torch.empty(S, total_rows, device=keys.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    out = torch.empty(n_wchunks, B, H, T, device=keys.device, dtype=torch.float32)
    valid8 = valid.to(torch.uint8).contiguous()
    block_d = head_block(D)
    sizes = dict(
        D=D, BLOCK_G=block_g, BLOCK_W=block_w, BLOCK_T=BLOCK_T, BLOCK_D=block_d,
        UPCAST=dot_upcast(queries.dtype), PRECISION=dot_precision(queries.dtype),
        **launch_options(block_d, queries.dtype, logits=block_g * block_w * BLOCK_T),
    )  # fmt: skip
    strides = (*queries.stride(), *keys.stride())
    scale_log2 = scaling * LOG2E
    tiles = (total_rows, T, W, n_tiles, n_wchunks, Hkv, G)
    _row_stats[check_grid((B * Hkv * n_tiles, S))](
        queries, keys, valid8, part_m, part_l, scale_log2, split_size, *tiles, *strides, **sizes
    )
    n_key_tiles = triton.cdiv(T, BLOCK_T)
    _column_sums[check_grid((B * Hkv * n_tiles * n_key_tiles,))](
        queries, keys, valid8, part_m, part_l, out, scale_log2, *tiles, S, n_key_tiles, *strides,
        BLOCK_S=BLOCK_S, **sizes,
    )  # fmt: skip
    return out[0] if n_wchunks == 1 else out.sum(0)
