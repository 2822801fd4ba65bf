"""Small tensor operations shared by scorers: GQA reduction, the layer-wide head mean and 1-D pooling
over tokens.

All reduce, so all compute in fp32 whatever the scores' dtype: a 16-bit mean or pooled sum
rounds near-equal scores to ties, and a tie decides by position which token is kept.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

GqaReduce = Literal["mean", "max", "sum"]
Pool = Literal["avg", "max", "none"]


def reduce_groups(scores: torch.Tensor, num_kv_heads: int, how: GqaReduce = "mean") -> torch.Tensor:
    """Aggregate query-head scores ``[B, H, T]`` to KV heads ``[B, Hkv, T]`` fp32.

    Query head ``h`` belongs to KV head ``h // G`` (transformers' ``repeat_kv`` order).
    """
    B, H, T = scores.shape
    grouped = scores.float().view(B, num_kv_heads, H // num_kv_heads, T)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    return grouped.sum(2)


def layer_mean(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Mean over every query head of the layer, ``[B, H, T]`` -> ``[B, Hkv, T]`` fp32, the same row for
    each KV head (methods that keep one token set per layer: TOVA; not a reduction within a GQA
    group, which :func:`reduce_groups` does)."""
    shared = scores.float().mean(1, keepdim=True)  # [B, 1, T]
    return shared.expand(-1, num_kv_heads, -1).contiguous()


def pool_tokens(scores: torch.Tensor, pool: Pool, kernel: int) -> torch.Tensor:
    """Pool ``[B, N, T]`` scores along tokens with stride 1 and ``padding = kernel // 2`` (fp32 out).

    ``avg`` pads with zeros and divides edge windows by ``kernel`` (``count_include_pad``, as
    SnapKV's ``F.avg_pool1d``); ``max`` pads with -inf. An even kernel is trimmed back to T.
    """
    scores = scores.float()
    if pool == "none" or kernel <= 1:
        return scores
    B, N, T = scores.shape
    flat = scores.reshape(B * N, 1, T)
    if pool == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    else:
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out[..., :T].reshape(B, N, T)
