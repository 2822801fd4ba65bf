"""Merge: scatter-reduce evicted KV pairs into their matched kept pairs (LOOK-M-style merge selectors).

``merged[n] = (kept_weight[n] * kept[n] + sum_{i: target[i] = n} evicted_weight[i] * evicted[i]) / Z[n]``

with ``Z[n] = kept_weight[n] + sum_{i: target[i] = n} evicted_weight[i]`` (``normalize:
weights``, a weighted mean) or ``Z[n] = kept_weight[n] + #{i: target[i] = n}`` (``normalize:
count``, ``scatter_reduce(mean, include_self=True)``, which LOOK-M's weighted merge uses: the
cosine weights scale the evicted entries but every entry counts 1 in the denominator, so the
result is not a convex combination and the weights may be negative). Missing weights are 1.
Kept rows no evicted entry points to are returned unchanged.

The three LOOK-M merge rules (Wan et al. 2024, "LOOK-M: Look-Once Optimization in KV Cache for
Efficient Multimodal Long-Context Inference"; ``docs/methods/lookm.md``) for keys (values the
same):

- averaged: ``merge_scatter(kc, ke, tgt)``;
- pivotal: ``merge_scatter(kc, (ke + kc[tgt]) / 2, tgt)`` (the pivot average is the source);
- weighted: ``merge_scatter(kc, ke, tgt, evicted_weight=sim, normalize="count")``.

Rows are flat over (sample, KV head): a selector concatenates every head's kept and evicted
entries and offsets ``target`` by the head's first kept row, so one call merges a layer.
"""

from __future__ import annotations

import torch

from kvlab.kernels.dispatch import launch_device, use_triton
from kvlab.kernels.types import Normalize


def merge_scatter_reference(
    kept: torch.Tensor,
    evicted: torch.Tensor,
    target: torch.Tensor,
    evicted_weight: torch.Tensor | None = None,
    kept_weight: torch.Tensor | None = None,
    normalize: Normalize = "weights",
) -> torch.Tensor:
    """Merged kept rows (see the module docstring).

    Args:
        kept: ``[N, D]`` kept entries (any float dtype).
        evicted: ``[M, D]`` evicted entries, same dtype.
        target: ``[M]`` long, the kept row each evicted entry merges into.
        evicted_weight: ``[M]`` float or None (all 1).
        kept_weight: ``[N]`` float or None (all 1).
        normalize: ``weights`` or ``count`` (the denominator).

    Returns:
        ``[N, D]`` in the dtype of ``kept``; sums and the division run in fp32.
    """
    N = kept.shape[0]
    ones = torch.ones(1, device=kept.device, dtype=torch.float32)
    ew = evicted_weight.float() if evicted_weight is not None else ones.expand(evicted.shape[0])
    kw = kept_weight.float() if kept_weight is not None else ones.expand(N)
    acc = (kw[:, None] * kept.float()).index_add(0, target, ew[:, None] * evicted.float())
    added = ew if normalize == "weights" else ones.expand(evicted.shape[0])
    denom = kw.index_add(0, target, added)
    return (acc / denom[:, None]).to(kept.dtype)


def merge_scatter(
    kept: torch.Tensor,
    evicted: torch.Tensor,
    target: torch.Tensor,
    evicted_weight: torch.Tensor | None = None,
    kept_weight: torch.Tensor | None = None,
    normalize: Normalize = "weights",
) -> torch.Tensor:
    """Dispatcher of :func:`merge_scatter_reference` (same arguments and result)."""
    if normalize not in ("weights", "count"):
        raise ValueError(f"normalize must be 'weights' or 'count', got {normalize!r}")
    if use_triton("merge_scatter", kept, evicted):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.merge import merge_scatter_triton as impl
    else:
        impl = merge_scatter_reference
    with launch_device(kept):
        return impl(kept, evicted, target, evicted_weight, kept_weight, normalize)
