"""Window-attention scoring for prefill (SnapKV-style scorers): column sums of the window's attention.

``window_attention_scores(queries, keys, valid, scaling)`` returns, per query head, how much
attention each key receives from the last ``W`` queries: ``[B, H, T]`` fp32, the sum over the
window of ``softmax(q_i K^T * scaling)`` with the causal mask inside the window and padding
keys masked (padding queries contribute nothing). It equals
``LayerContext.window_attention(W).sum(-2)``.

Why the kernel stops at per-query-head sums: the ``W x T x H`` probabilities are the only
quantity that grows with ``W * T`` and is what the Triton kernel never materialises (two passes
over the keys: online-softmax row statistics, then column sums; memory ``O(H * T)``). What the
scorers do next (mean over the window = sum / W, GQA reduction by mean/max/sum in either order
with pooling, avg/max pooling with any kernel, kvpress' pool-then-group order) is linear in
``H * T`` and differs between methods, so it stays in torch (:mod:`kvlab.compression.ops`).
"""

from __future__ import annotations

import torch

from kvlab.kernels.dispatch import use_triton


def window_attention_scores_reference(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Column sums of the window attention, materialising ``[B, H, W, T]`` fp32 (the naive way).

    Args:
        queries: ``[B, H, W, D]`` post-RoPE queries of the last ``W`` prompt positions
            (query ``i`` is at position ``T - W + i``).
        keys: ``[B, Hkv, T, D]`` post-RoPE keys; query head ``h`` reads KV head ``h // (H / Hkv)``.
        valid: ``[B, T]`` bool, False on padding (left padding).
        scaling: softmax scale.

    Returns:
        ``[B, H, T]`` fp32: ``sum_i softmax_t(q_i . k_t * scaling)`` over valid window queries.
    """
    B, H, W, D = queries.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(B, Hkv, H // Hkv * W, D)
    logits = (torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling).view(B, H, W, T)
    query_pos = torch.arange(T - W, T, device=keys.device)
    causal = torch.arange(T, device=keys.device)[None, :] <= query_pos[:, None]  # [W, T]
    logits = logits.masked_fill(~(causal[None, None] & valid[:, None, None, :]), float("-inf"))
    query_valid = valid[:, T - W :]  # [B, W]
    logits = logits.masked_fill(~query_valid[:, None, :, None], 0.0)
    probs = torch.softmax(logits, dim=-1) * query_valid[:, None, :, None]
    return probs.sum(-2)


def window_attention_scores(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Dispatcher of :func:`window_attention_scores_reference` (same arguments and result)."""
    if use_triton("window_attention_scores", queries, keys):
        from kvlab.kernels.tl.window_scores import window_attention_scores_triton as impl
    else:
        impl = window_attention_scores_reference
    return impl(queries, keys, valid, scaling)
