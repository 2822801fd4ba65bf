"""Window-attention scoring for prefill (SnapKV-style scorers): column sums of the window's attention.

``window_attention_scores(queries, keys, valid, scaling)`` returns, per query head, how much
attention each key receives from the last ``W`` queries: ``[B, H, T]`` fp32, the sum over the
window of ``softmax(q_i K^T * scaling)`` with the causal mask inside the window and padding
keys masked (padding queries contribute nothing). It equals
``LayerContext.window_attention(W).sum(-2)``.

Why the kernel stops at per-query-head sums: the ``W x T x H`` probabilities are the only
quantity that grows with ``W * T`` and is what the Triton kernel never materialises (two passes
over the keys: online-softmax row statistics, then column sums; memory ``O(H * T)``). The torch
reference computes the same sums a bounded block at a time (:data:`REFERENCE_BLOCK_ELEMENTS`), so
it never holds the whole ``W x T x H`` either. What the
scorers do next (mean over the window = sum / W, GQA reduction by mean/max/sum in either order
with pooling, avg/max pooling with any kernel, kvpress' pool-then-group order) is linear in
``H * T`` and differs between methods, so it stays in torch (:mod:`kvlab.compression.ops`).
"""

from __future__ import annotations

import torch

from kvlab.kernels.dispatch import launch_device, use_triton

#: fp32 elements of one block of the torch reference (``samples x heads x window rows x T``):
#: 2**24 are 64 MiB, so the reference's working set stays ``O(T)`` at any prompt length.
REFERENCE_BLOCK_ELEMENTS = 1 << 24


def window_attention_scores_reference(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    block_elements: int | None = None,
) -> torch.Tensor:
    """Column sums of the window attention in torch, a bounded block of probabilities at a time.

    Args:
        queries: ``[B, H, W, D]`` post-RoPE queries of the last ``W`` prompt positions
            (query ``i`` is at position ``T - W + i``).
        keys: ``[B, Hkv, T, D]`` post-RoPE keys; query head ``h`` reads KV head ``h // (H / Hkv)``.
        valid: ``[B, T]`` bool, False on padding (left padding).
        scaling: softmax scale.
        block_elements: most fp32 probabilities held at once: blocks of (sample, KV head) pairs,
            of the query heads of one KV head, and of window rows, ``n x h x w x T <=
            block_elements`` (at least one row; default :data:`REFERENCE_BLOCK_ELEMENTS`). One
            block when everything fits (short prompts).

    Returns:
        ``[B, H, T]`` fp32: ``sum_i softmax_t(q_i . k_t * scaling)`` over valid window queries.
    """
    B, H, W, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = H // Hkv
    block_elements = block_elements or REFERENCE_BLOCK_ELEMENTS
    rows = min(W, max(1, block_elements // T))
    heads = min(G, max(1, block_elements // (rows * T))) if rows == W else 1
    pairs = min(B * Hkv, max(1, block_elements // (G * W * T))) if heads == G else 1
    grouped = queries.reshape(B * Hkv, G, W, D)  # (sample, KV head) pairs, their query heads
    keys = keys.float().reshape(B * Hkv, T, D)
    key_valid = valid[:, None, :].expand(B, Hkv, T).reshape(B * Hkv, T)
    out = torch.zeros(B * Hkv, G, T, dtype=torch.float32, device=keys.device)
    for w0 in range(0, W, rows):
        w1 = min(W, w0 + rows)
        query_pos = torch.arange(T - W + w0, T - W + w1, device=keys.device)
        causal = torch.arange(T, device=keys.device)[None, :] <= query_pos[:, None]  # [w, T]
        query_valid = key_valid[:, T - W + w0 : T - W + w1]  # [B * Hkv, w]
        for p0 in range(0, B * Hkv, pairs):
            p1 = min(B * Hkv, p0 + pairs)
            allowed = causal[None, None] & key_valid[p0:p1, None, None, :]  # [n, 1, w, T]
            row_valid = query_valid[p0:p1, None, :, None]  # [n, 1, w, 1]
            for h0 in range(0, G, heads):
                h1 = min(G, h0 + heads)
                block = grouped[p0:p1, h0:h1, w0:w1].float()  # [n, h, w, D]
                n, h, w = block.shape[:3]
                logits = torch.matmul(block.reshape(n, h * w, D), keys[p0:p1].transpose(-1, -2)) * scaling
                logits = logits.view(n, h, w, T).masked_fill(~allowed, float("-inf"))
                logits = logits.masked_fill(~row_valid, 0.0)
                probs = torch.softmax(logits, dim=-1) * row_valid
                out[p0:p1, h0:h1] += probs.sum(-2)
    return out.view(B, H, T)


def window_attention_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    block_elements: int | None = None,
) -> torch.Tensor:
    """Dispatcher of :func:`window_attention_scores_reference` (same arguments and result;
    ``block_elements`` bounds the reference's blocks, the Triton kernel holds no block)."""
    if use_triton("window_attention_scores", queries, keys):
        # triton is an optional dependency: imported only when the Triton path runs
        from kvlab.kernels.tl.window_scores import window_attention_scores_triton

        with launch_device(keys):
            return window_attention_scores_triton(queries, keys, valid, scaling)
    return window_attention_scores_reference(queries, keys, valid, scaling, block_elements)
