"""Compaction: gather the kept positions of every (sample, KV head) into the flat cache layout.

``compact_kv`` is what :meth:`kvlab.cache.layer.CompressedLayer.compress` calls; it dispatches
(:mod:`kvlab.kernels.dispatch`) to the Triton kernel in :mod:`kvlab.kernels.tl.compaction` on
CUDA tensors (keys and values gathered in one pass, straight into the flat buffers, with no
``[B, Hkv, K, D]`` intermediate) and to :func:`compact_kv_reference` elsewhere.
"""

from __future__ import annotations

import torch

from kvlab.kernels.dispatch import launch_device, use_triton
from kvlab.kernels.types import Compacted, segment_starts


def compact_kv_reference(
    keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None, counts: torch.Tensor
) -> Compacted:
    """Kept entries of every (sample, KV head), concatenated in (sample, head, position) order.

    Args:
        keys / values: ``[B, Hkv, T, D]`` any float dtype.
        indices: ``[B, Hkv, K]`` long, kept positions per (sample, head) (entries past
            ``counts[b, h]`` are ignored), or None to take positions ``0 .. counts-1`` (the
            replacement entries of a merge selector, already ``[B, Hkv, K, D]``).
        counts: ``[B, Hkv]`` long, kept entries per (sample, head); 0 is allowed.

    Returns:
        ``(prompt_keys [N, D], prompt_values [N, D], starts [B, Hkv], lengths [B, Hkv])`` with
        N = ``counts.sum()``, in the input dtype, int64 offsets.
    """
    D = keys.shape[-1]
    lengths = counts.to(torch.int64)
    if indices is not None:
        index = indices[..., None].expand(-1, -1, -1, D)
        keys, values = keys.gather(2, index), values.gather(2, index)
    K = keys.shape[2] if indices is None else indices.shape[-1]
    mask = torch.arange(K, device=keys.device) < lengths[..., None]
    return (
        keys[:, :, :K][mask].contiguous(),
        values[:, :, :K][mask].contiguous(),
        segment_starts(lengths),
        lengths,
    )


def compact_kv(
    keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None, counts: torch.Tensor
) -> Compacted:
    """Dispatcher of :func:`compact_kv_reference` (same arguments and result)."""
    if use_triton("compact_kv", keys, values):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.compaction import compact_kv_triton as impl
    else:
        impl = compact_kv_reference
    with launch_device(keys):
        return impl(keys, values, indices, counts)
