"""RouteDecision: what a route did at one layer (the rule's output, the branches' input).

A route rule (:mod:`kvlab.compression.routing`) returns one per layer; the pipeline runs the
branches it names and hands it to their components as :attr:`LayerContext.route
<kvlab.compression.context.LayerContext.route>` (a per-head rule's classes reach HybridKV's
allocator that way), and the layer report keeps it for the predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouteDecision:
    """What a route did at one layer.

    Attributes:
        branches: branch name per sample (``[B]`` strings).
        switched: ``[B]`` bool, True once the rule has switched to its ``after`` branch.
        metric: ``[B]`` the rule's metric at this layer (NaN where not evaluated), or None.
        heads: per-head rules (``per_head``): ``[B, Hkv]`` long, the branch of every (sample, KV
            head) as an index into ``head_names``; the pipeline then combines the branches'
            selections head by head (``branches`` only summarises each sample). None otherwise.
        head_names: the branch names ``heads`` indexes.
    """

    branches: list[str]
    switched: torch.Tensor
    metric: torch.Tensor | None = None
    heads: torch.Tensor | None = None
    head_names: tuple[str, ...] = ()
