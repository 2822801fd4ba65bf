"""A user's own component module, outside kvlab: loaded by tests/test_plugins.py through
``imports:`` (not a test module: pytest does not collect it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer


@IMPORTANCE.register("my_scorer")
@dataclass
class OldestFirstScorer(ImportanceScorer):
    """Keeps the earliest prompt tokens: ``s_t = -scale * t``."""

    scale: float = 1.0

    calls: ClassVar[list[int]] = []  # layer of every call, so a test can see that it ran

    def score(self, ctx: LayerContext) -> torch.Tensor:
        OldestFirstScorer.calls.append(ctx.layer_idx)
        batch, heads, length = ctx.keys.shape[:3]
        positions = torch.arange(length, dtype=torch.float32, device=ctx.keys.device)
        return (-self.scale * positions).repeat(batch, heads, 1)
