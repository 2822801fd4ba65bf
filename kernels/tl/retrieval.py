"""Triton chunk retrieval: chunk scores or page bounds, an exact top-k by radix search, the gather.

Four kernels, all with one-dimensional grids and 64-bit offsets:

1. ``_chunk_scores``, grid ``(R * q * ceil(NC / BLOCK_N),)``: a program averages the ``G``
   query vectors of its (row, query) (``BLOCK_G`` padded), then scores ``BLOCK_N`` chunk mean
   keys with an fp32 dot over the head dim, -inf on invalid chunks, into ``[R, q, NC]`` fp32.
2. ``_chunk_select``, grid ``(R * q,)``: the top ``k = min(n_sel[r], valid chunks)`` of a score
   row without sorting it. Scores are mapped to order-preserving int32 keys (the float's bits,
   negative ones with their 31 magnitude bits flipped); a binary search over the 2**32 key
   values (32 passes of counting, ``BLOCK_N`` scores at a time) finds the k-th largest key
   ``t``; a last pass writes every chunk with a key above ``t`` and the first ``k - #above``
   chunks equal to ``t`` in chunk order (a stable sort's tie rule), ascending, through an
   exclusive prefix sum. Exact: the same chunks as the reference's stable sort.
3. ``_gather_chunks``, grid ``(R * q * S,)``: a program copies one chosen chunk (``chunk``
   tokens, ``BLOCK_T`` padded) of keys and values from the host store to the device buffer,
   zeros for an empty slot (id -1). On a GPU the store is pinned host memory, which the device
   addresses directly (unified virtual addressing), so the chunk ids never go to the host.

4. ``_page_bounds``, grid ``(R * q * ceil(NC / BLOCK_N),)``: Quest's index instead of 1. A program
   averages its (row, query)'s ``G`` queries as ``_chunk_scores`` does, then bounds ``BLOCK_N``
   pages from their per-channel key minimum and maximum (``[R, NC, 2, D]``):
   ``sum_d where(qbar_d >= 0, qbar_d M_d, qbar_d m_d)`` in fp32, -inf on empty pages; the
   selection is ``_chunk_select``'s.

Only ``D`` and the tile sizes are compile-time constants; chunk counts, queries, slots, the
chunk size and the group size are runtime arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.tl.common import check_grid, head_block, launch_options, pow2

SCORE_TILE = 64  # chunks scored per program
SELECT_TILE = 256  # scores read per step of the selection passes


@triton.jit(do_not_specialize=["NC", "Q", "G", "n_tiles"])
def _chunk_scores(
    q_ptr, idx_ptr, rows_ptr, cvalid_ptr, out_ptr, NC, Q, G, n_tiles,
    sq_b, sq_h, sq_q, sq_d, si_r, si_c, si_d,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    tile = pid % n_tiles
    ri = pid // n_tiles  # r * Q + i
    r = ri // Q
    i = ri % Q
    b = tl.load(rows_ptr + r * 2).to(tl.int64)
    h = tl.load(rows_ptr + r * 2 + 1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q_off = b * sq_b + (h * G + g)[:, None] * sq_h + i * sq_q + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    qbar = tl.sum(q, 0) / G  # [BLOCK_D]: the group's mean query
    c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < NC
    k_off = r * si_r + c[:, None] * si_c + d[None, :] * si_d
    k = tl.load(idx_ptr + k_off, mask=c_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    score = tl.sum(k * qbar[None, :], 1)
    ok = c_ok & (tl.load(cvalid_ptr + r * NC + c, mask=c_ok, other=0) != 0)
    tl.store(out_ptr + ri * NC + c, tl.where(ok, score, float("-inf")), mask=c_ok)


@triton.jit(do_not_specialize=["NC", "Q", "G", "n_tiles"])
def _page_bounds(
    q_ptr, idx_ptr, rows_ptr, cvalid_ptr, out_ptr, NC, Q, G, n_tiles,
    sq_b, sq_h, sq_q, sq_d, si_r, si_c, si_p, si_d,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    tile = pid % n_tiles
    ri = pid // n_tiles  # r * Q + i
    r = ri // Q
    i = ri % Q
    b = tl.load(rows_ptr + r * 2).to(tl.int64)
    h = tl.load(rows_ptr + r * 2 + 1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q_off = b * sq_b + (h * G + g)[:, None] * sq_h + i * sq_q + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    qbar = tl.sum(q, 0) / G  # [BLOCK_D]: the group's mean query
    c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < NC
    k_mask = c_ok[:, None] & (d < D)[None, :]
    k_off = r * si_r + c[:, None] * si_c + d[None, :] * si_d
    low = tl.load(idx_ptr + k_off, mask=k_mask, other=0.0).to(tl.float32)
    high = tl.load(idx_ptr + k_off + si_p, mask=k_mask, other=0.0).to(tl.float32)
    scaled = qbar[None, :]
    bound = tl.sum(tl.where(scaled >= 0, scaled * high, scaled * low), 1)
    ok = c_ok & (tl.load(cvalid_ptr + r * NC + c, mask=c_ok, other=0) != 0)
    tl.store(out_ptr + ri * NC + c, tl.where(ok, bound, float("-inf")), mask=c_ok)


@triton.jit
def _keys(s):
    """Order-preserving int64 keys of fp32 scores (the int32 bits, negatives' magnitude flipped)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit(do_not_specialize=["NC", "Q", "width"])
def _chunk_select(s_ptr, nsel_ptr, out_ptr, NC, Q, width, BLOCK_N: tl.constexpr):
    ri = tl.program_id(0).to(tl.int64)
    row = s_ptr + ri * NC
    n_valid = tl.full([], 0, tl.int32)
    for n0 in range(0, NC, BLOCK_N):
        c = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(row + c, mask=c < NC, other=float("-inf"))
        n_valid += tl.sum((s > float("-inf")).to(tl.int32), 0)
    k = tl.minimum(tl.load(nsel_ptr + ri // Q).to(tl.int32), n_valid)
    lo = tl.full([], -2147483648, tl.int64)  # count(key >= lo) >= k holds; find the largest such lo
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.full([], 0, tl.int32)
        for n0 in range(0, NC, BLOCK_N):
            c = n0 + tl.arange(0, BLOCK_N)
            s = tl.load(row + c, mask=c < NC, other=float("-inf"))
            above = (s > float("-inf")) & (_keys(s) >= mid)
            count += tl.sum(above.to(tl.int32), 0)
        enough = count >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    greater = tl.full([], 0, tl.int32)
    for n0 in range(0, NC, BLOCK_N):
        c = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(row + c, mask=c < NC, other=float("-inf"))
        greater += tl.sum(((s > float("-inf")) & (_keys(s) > lo)).to(tl.int32), 0)
    need = k - greater  # chunks equal to the k-th key to take, lowest chunk first
    written = tl.full([], 0, tl.int32)
    equal_seen = tl.full([], 0, tl.int32)
    for n0 in range(0, NC, BLOCK_N):
        c = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(row + c, mask=c < NC, other=float("-inf"))
        valid = s > float("-inf")
        key = _keys(s)
        equal = (valid & (key == lo)).to(tl.int32)
        equal_rank = tl.cumsum(equal, 0) - equal + equal_seen
        keep = (valid & (key > lo)) | ((equal != 0) & (equal_rank < need))
        keep_i = keep.to(tl.int32)
        slot = tl.cumsum(keep_i, 0) - keep_i + written
        tl.store(out_ptr + ri * width + slot, c.to(tl.int64), mask=keep)
        written += tl.sum(keep_i, 0)
        equal_seen += tl.sum(equal, 0)


@triton.jit(do_not_specialize=["QS", "chunk"])
def _gather_chunks(
    hk_ptr, hv_ptr, ids_ptr, ok_ptr, ov_ptr, QS, chunk, sh_r, sh_t, sh_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # (r * q + i) * S + s
    r = pid // QS
    cid = tl.load(ids_ptr + pid).to(tl.int64)
    j = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    in_chunk = (j < chunk)[:, None] & (d < D)[None, :]
    read = in_chunk & ((cid + j * 0) >= 0)[:, None]  # an empty slot (id -1) is written as zeros
    src = r * sh_r + (cid * chunk + j)[:, None] * sh_t + d[None, :] * sh_d
    dst = (pid * chunk + j)[:, None] * D + d[None, :]
    tl.store(ok_ptr + dst, tl.load(hk_ptr + src, mask=read, other=0.0), mask=in_chunk)
    tl.store(ov_ptr + dst, tl.load(hv_ptr + src, mask=read, other=0.0), mask=in_chunk)


LAUNCHED = (_chunk_scores, _page_bounds, _chunk_select, _gather_chunks)


def chunk_topk_triton(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.retrieval.chunk_topk_reference`.

    ``width`` (``max(n_sel)``, capped at the chunk count) saves a host sync when the caller knows it.
    """
    B, H, q, D = query.shape
    R, NC = chunk_valid.shape
    if width is None:
        width = int(n_sel.max()) if R else 0
    width = min(width, NC)
    out = torch.full((R, q, width), -1, dtype=torch.long, device=query.device)
    if R == 0 or width == 0:
        return out
    G = H // num_kv_heads
    scores = torch.empty(R, q, NC, dtype=torch.float32, device=query.device)
    rows = rows.to(torch.int64).contiguous()
    block_d = head_block(D)
    n_tiles = triton.cdiv(NC, SCORE_TILE)
    _chunk_scores[check_grid((R * q * n_tiles,))](
        query, index, rows, chunk_valid.to(torch.uint8).contiguous(), scores, NC, q, G, n_tiles,
        *query.stride(), *index.stride(),
        D=D, BLOCK_G=pow2(G), BLOCK_N=SCORE_TILE, BLOCK_D=block_d,
        num_warps=launch_options(block_d, query.dtype)["num_warps"],
    )  # fmt: skip
    _chunk_select[check_grid((R * q,))](
        scores, n_sel.to(torch.int64).contiguous(), out, NC, q, width, BLOCK_N=SELECT_TILE, num_warps=4
    )
    return out


def page_bounds_triton(
    query: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, chunk_valid: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.retrieval.page_bounds_reference` (``[R, q, NC]`` fp32)."""
    B, H, q, D = query.shape
    R, NC = chunk_valid.shape
    bounds = torch.empty(R, q, NC, dtype=torch.float32, device=query.device)
    if bounds.numel() == 0:
        return bounds
    block_d = head_block(D)
    n_tiles = triton.cdiv(NC, SCORE_TILE)
    _page_bounds[check_grid((R * q * n_tiles,))](
        query, index, rows.to(torch.int64).contiguous(), chunk_valid.to(torch.uint8).contiguous(), bounds,
        NC, q, H // num_kv_heads, n_tiles, *query.stride(), *index.stride(),
        D=D, BLOCK_G=pow2(H // num_kv_heads), BLOCK_N=SCORE_TILE, BLOCK_D=block_d,
        num_warps=launch_options(block_d, query.dtype)["num_warps"],
    )  # fmt: skip
    return bounds


def page_topk_triton(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kvlab.kernels.retrieval.page_topk_reference` (``index [R, NC, 2, D]``):
    :func:`page_bounds_triton`, then ``_chunk_select``."""
    q = query.shape[2]
    R, NC = chunk_valid.shape
    if width is None:
        width = int(n_sel.max()) if R else 0
    width = min(width, NC)
    out = torch.full((R, q, width), -1, dtype=torch.long, device=query.device)
    if R == 0 or width == 0:
        return out
    bounds = page_bounds_triton(query, index, rows, chunk_valid, num_kv_heads)
    _chunk_select[check_grid((R * q,))](
        bounds, n_sel.to(torch.int64).contiguous(), out, NC, q, width, BLOCK_N=SELECT_TILE, num_warps=4
    )
    return out


def gather_chunks_triton(
    host_keys: torch.Tensor, host_values: torch.Tensor, ids: torch.Tensor, chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~kvlab.kernels.retrieval.gather_chunks_reference`."""
    R, q, S = ids.shape
    D = host_keys.shape[-1]
    out_k = torch.empty(R, q, S * chunk, D, dtype=host_keys.dtype, device=device)
    out_v = torch.empty_like(out_k)
    if ids.numel() == 0:
        return out_k, out_v
    keys, values = host_keys.contiguous(), host_values.contiguous()
    _gather_chunks[check_grid((R * q * S,))](
        keys, values, ids.contiguous(), out_k, out_v, q * S, chunk, *keys.stride(),
        D=D, BLOCK_T=pow2(chunk), BLOCK_D=head_block(D), num_warps=2,
    )  # fmt: skip
    return out_k, out_v
