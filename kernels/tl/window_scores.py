"""Triton window-attention scores: two passes over the keys, never the ``[B, H, W, T]`` probabilities.

Rows of one program are a tile of ``BLOCK_G`` query heads of one KV group times ``BLOCK_W``
window queries (<= 128 rows), so every key tile is loaded once for the whole tile (GQA aware).

1. ``_row_stats``, grid ``(B * Hkv * tiles, S)``: online-softmax maximum and sum of exponentials
   of every window row over keys ``[s*split, (s+1)*split)`` (split-K, so a long prompt with few
   heads still fills the device); partials ``[S, B*H*W]`` fp32.
2. ``_column_sums``, grid ``(B * Hkv * tiles, ceil(T / BLOCK_T))``: merge the row statistics,
   recompute the logits of one key tile, normalise, mask, and sum over the tile's window rows
   per query head into ``[chunks, B, H, T]`` (``chunks = ceil(W / 128)``, summed in torch).

Extra memory: ``O(S * H * W + H * T)`` fp32 instead of ``B * H * W * T`` fp32 several times over.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import dot_upcast
from kvlab.kernels.tl.common import dot, parallel_slots, pow2

LOG2E = 1.4426950408889634
EMPTY = -1.0e30
MAX_ROWS = 128


@triton.jit
def _tile_rows(
    q_ptr, valid_ptr, tile, sq_b, sq_h, sq_w, sq_d,
    H: tl.constexpr, HKV: tl.constexpr, W: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    N_TILES: tl.constexpr, N_WCHUNKS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Indices of a row tile: sample, KV head, query heads, window rows, queries, row masks."""
    G: tl.constexpr = H // HKV
    bh = tile // N_TILES
    t = tile % N_TILES
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, BLOCK_G * BLOCK_W)
    g = (t // N_WCHUNKS) * BLOCK_G + r // BLOCK_W
    i = (t % N_WCHUNKS) * BLOCK_W + r % BLOCK_W
    row_ok = (g < G) & (i < W)
    query_pos = T - W + i
    row_ok = row_ok & (tl.load(valid_ptr + b * T + query_pos, mask=row_ok, other=0) != 0)
    d = tl.arange(0, BLOCK_D)
    q_off = b * sq_b + (h * G + g) * sq_h + i * sq_w
    q = tl.load(
        q_ptr + q_off[:, None] + d[None, :] * sq_d, mask=row_ok[:, None] & (d < D)[None, :], other=0.0
    )
    stat_row = (b * H + h * G + g) * W + i
    return b, h, g, q, query_pos, row_ok, stat_row


@triton.jit
def _logits(
    q, k_ptr, valid_ptr, b, h, n0, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
    T: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
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
    return tl.where(visible, dot(q, tl.trans(k), UPCAST) * scale_log2, float("-inf")), visible


@triton.jit
def _row_stats(
    q_ptr, k_ptr, valid_ptr, part_m, part_l, scale_log2, split, total_rows,
    sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_t, sk_d,
    H: tl.constexpr, HKV: tl.constexpr, W: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    N_TILES: tl.constexpr, N_WCHUNKS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    b, h, g, q, query_pos, row_ok, stat_row = _tile_rows(
        q_ptr, valid_ptr, tl.program_id(0), sq_b, sq_h, sq_w, sq_d,
        H, HKV, W, T, D, N_TILES, N_WCHUNKS, BLOCK_G, BLOCK_W, BLOCK_D,
    )  # fmt: skip
    s = tl.program_id(1)
    m = tl.full([BLOCK_G * BLOCK_W], EMPTY, tl.float32)
    lsum = tl.zeros([BLOCK_G * BLOCK_W], tl.float32)
    for n0 in range(s * split, tl.minimum(s * split + split, T), BLOCK_T):
        logits, _ = _logits(
            q, k_ptr, valid_ptr, b, h, n0, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
            T, D, BLOCK_T, BLOCK_D, UPCAST,
        )  # fmt: skip
        m_new = tl.maximum(m, tl.max(logits, 1))
        lsum = lsum * tl.exp2(m - m_new) + tl.sum(tl.exp2(logits - m_new[:, None]), 1)
        m = m_new
    tl.store(part_m + s * total_rows + stat_row, m, mask=row_ok)
    tl.store(part_l + s * total_rows + stat_row, lsum, mask=row_ok)


@triton.jit
def _column_sums(
    q_ptr, k_ptr, valid_ptr, part_m, part_l, out_ptr, scale_log2, total_rows,
    sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_t, sk_d,
    H: tl.constexpr, HKV: tl.constexpr, W: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    N_TILES: tl.constexpr, N_WCHUNKS: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    b, h, g, q, query_pos, row_ok, stat_row = _tile_rows(
        q_ptr, valid_ptr, tile, sq_b, sq_h, sq_w, sq_d,
        H, HKV, W, T, D, N_TILES, N_WCHUNKS, BLOCK_G, BLOCK_W, BLOCK_D,
    )  # fmt: skip
    s = tl.arange(0, BLOCK_S)
    idx = s[:, None] * total_rows + stat_row[None, :]
    ok = (s < S)[:, None] & row_ok[None, :]
    m_parts = tl.load(part_m + idx, mask=ok, other=EMPTY)
    l_parts = tl.load(part_l + idx, mask=ok, other=0.0)
    m = tl.max(m_parts, 0)
    lsum = tl.sum(l_parts * tl.exp2(m_parts - m[None, :]), 0)
    inv_l = tl.where(row_ok & (lsum > 0), 1.0 / tl.where(lsum > 0, lsum, 1.0), 0.0)

    n0 = tl.program_id(1) * BLOCK_T
    logits, visible = _logits(
        q, k_ptr, valid_ptr, b, h, n0, query_pos, row_ok, scale_log2, sk_b, sk_h, sk_t, sk_d,
        T, D, BLOCK_T, BLOCK_D, UPCAST,
    )  # fmt: skip
    probs = tl.where(visible, tl.exp2(logits - m[:, None]) * inv_l[:, None], 0.0)
    per_head = tl.sum(tl.reshape(probs, [BLOCK_G, BLOCK_W, BLOCK_T]), 1)  # [BLOCK_G, BLOCK_T]

    G: tl.constexpr = H // HKV
    t = n0 + tl.arange(0, BLOCK_T)
    gl = tl.arange(0, BLOCK_G)
    head_g = ((tile % N_TILES) // N_WCHUNKS) * BLOCK_G + gl
    chunk = (tile % N_TILES) % N_WCHUNKS
    rows = ((chunk * (total_rows // W)) + b * H + h * G + head_g) * T
    tl.store(out_ptr + rows[:, None] + t[None, :], per_head, mask=(head_g < G)[:, None] & (t < T)[None, :])


def window_attention_scores_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    split_size: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.window_scores.window_attention_scores_reference`.

    ``split_size`` (keys per split of the statistics pass) overrides the automatic sizing.
    """
    B, H, W, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = H // Hkv
    block_w = min(pow2(W), MAX_ROWS)
    block_g = min(pow2(G), max(1, MAX_ROWS // block_w))
    if block_g * block_w < 16:  # tl.dot needs 16 rows: pad with empty window rows
        block_w = 16 // block_g
    n_wchunks = triton.cdiv(W, block_w)
    n_tiles = triton.cdiv(G, block_g) * n_wchunks
    block_t = 64
    if split_size is None:
        wanted = max(1, -(-parallel_slots(keys.device) // (B * Hkv * n_tiles)))
        split_size = max(1024, -(-T // wanted))
    split_size = -(-split_size // block_t) * block_t
    S = triton.cdiv(T, split_size)
    total_rows = B * H * W
    part_m = torch.empty(S, total_rows, device=keys.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    out = torch.empty(n_wchunks, B, H, T, device=keys.device, dtype=torch.float32)
    valid8 = valid.to(torch.uint8).contiguous()
    sizes = dict(
        H=H, HKV=Hkv, W=W, T=T, D=D, N_TILES=n_tiles, N_WCHUNKS=n_wchunks,
        BLOCK_G=block_g, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_D=pow2(D),
        UPCAST=dot_upcast(queries.dtype),
    )  # fmt: skip
    strides = (*queries.stride(), *keys.stride())
    scale_log2 = scaling * LOG2E
    _row_stats[(B * Hkv * n_tiles, S)](
        queries, keys, valid8, part_m, part_l, scale_log2, split_size, total_rows, *strides, **sizes
    )
    _column_sums[(B * Hkv * n_tiles, triton.cdiv(T, block_t))](
        queries, keys, valid8, part_m, part_l, out, scale_log2, total_rows, *strides,
        S=S, BLOCK_S=pow2(S), **sizes,
    )  # fmt: skip
    return out[0] if n_wchunks == 1 else out.sum(0)
