"""Budget allocators: per layer, per head, per modality.

- A layer allocator turns the per-head budget of each sample into this layer's per-head budget.
- A head allocator splits a layer's free budget (budget minus protected tokens) among KV heads.
- A modality allocator (slot; ``none`` today) may split a head's budget across modalities.

All budgets count tokens per KV head; protected tokens are inside the layer budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.registry import Registry


class LayerAllocator:
    """Base class: override :meth:`allocate`."""

    registry_name: str = ""

    def allocate(
        self, budget: torch.Tensor, lengths: torch.Tensor, protected: torch.Tensor, ctx: LayerContext
    ):
        """Per-head budget of this layer, ``[B]`` long.

        Args:
            budget: the configured per-head budget of each sample, ``[B]`` (protected included).
            lengths: prompt lengths ``[B]``.
            protected: protected tokens per sample ``[B]`` (the window, plus sinks).
            ctx: the layer (``ctx.layer_idx``, ``ctx.num_layers``).
        """
        raise NotImplementedError


class HeadAllocator:
    """Base class: override :meth:`allocate`."""

    registry_name: str = ""

    def allocate(self, scores: torch.Tensor, free: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """Split each sample's free budget across KV heads.

        Args:
            scores: ``[B, Hkv, T]`` candidate scores (-inf on padding and protected tokens).
            free: ``[B]`` tokens per head to keep beyond the protected ones (layer average).
        Returns:
            ``[B, Hkv]`` long: candidates kept per head. A ragged result is fine: the cache
            stores each head's own count.
        """
        raise NotImplementedError


class ModalityAllocator:
    """Base class: override :meth:`allocate` (returns None for a unified, modality-blind budget)."""

    registry_name: str = ""

    def allocate(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> torch.Tensor | None:
        """``[B, Hkv, 3]`` candidates kept per modality (text, image, video), or None."""
        raise NotImplementedError


LAYER_ALLOCATORS: Registry[LayerAllocator] = Registry("layer allocator", "model.compression.allocate.layer")
HEAD_ALLOCATORS: Registry[HeadAllocator] = Registry("head allocator", "model.compression.allocate.head")
MODALITY_ALLOCATORS: Registry[ModalityAllocator] = Registry(
    "modality allocator", "model.compression.allocate.modality"
)


@LAYER_ALLOCATORS.register("uniform")
@dataclass
class UniformLayerAllocator(LayerAllocator):
    """Every layer gets the configured budget."""

    def allocate(self, budget, lengths, protected, ctx):
        return budget


@LAYER_ALLOCATORS.register("pyramid")
@dataclass
class PyramidLayerAllocator(LayerAllocator):
    """PyramidKV (Cai et al. 2024): budgets fall linearly from the first layer to the last.

    With C the per-head budget, w the protected tokens, B' = C - w the free budget, T the
    prompt length and L layers (KVCache-Factory ``PyramidKVCluster``, integer arithmetic)::

        min = B' // beta ; max = 2 B' - min
        if max >= T - w:  max = T - w ; min = 2 B' - max
        steps = (max - min) // (L - 1)
        cap_l = max - l * steps                          # free tokens kept at layer l
        T < C        -> no compression;   T < 2 B' -> cap_l = B' (SnapKV)

    so the mean over layers is B' (up to the floor of ``steps``: at most (L-1)/2 tokens more
    per layer). ``arithmetic: float`` is kvpress' ``PyramidKVPress.get_layer_budget``: it
    schedules the whole budget n = C (window included, since kvpress' C - w is n_kept) with
    real-valued steps and ``round``, and returns the uniform budget whenever
    ``not T >= max >= min >= w``.
    """

    beta: int = 20
    arithmetic: Literal["int", "float"] = "int"

    def __post_init__(self) -> None:
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def allocate(self, budget, lengths, protected, ctx):
        out = budget.clone()
        L, layer = ctx.num_layers, ctx.layer_idx
        for b, (capacity, T, w) in enumerate(
            zip(budget.tolist(), lengths.tolist(), protected.tolist(), strict=True)
        ):
            free = capacity - w
            if L < 2 or capacity >= T:
                continue
            if self.arithmetic == "int":
                out[b] = w + self._int_schedule(free, T, w, L, layer)
            else:
                out[b] = self._float_schedule(capacity, T, w, L, layer)
        return out

    def _int_schedule(self, free: int, T: int, w: int, L: int, layer: int) -> int:
        if 2 * free > T:
            return free
        min_num = free // self.beta
        max_num = 2 * free - min_num
        if max_num >= T - w:
            max_num = T - w
            min_num = 2 * free - max_num
        steps = (max_num - min_num) // (L - 1)
        return max_num - layer * steps

    def _float_schedule(self, kept: int, T: int, w: int, L: int, layer: int) -> int:
        min_num = kept / self.beta
        max_num = 2 * kept - min_num
        if max_num >= T - w:
            max_num = T - w
            min_num = 2 * kept - max_num
        if not (T >= max_num >= min_num >= w):
            return kept
        steps = (max_num - min_num) / (L - 1)
        return round(max_num - layer * steps)


@HEAD_ALLOCATORS.register("uniform")
@dataclass
class UniformHeadAllocator(HeadAllocator):
    """Every KV head keeps the same number of tokens."""

    def allocate(self, scores, free, ctx):
        return free[:, None].expand(-1, ctx.num_kv_heads).clone()


@MODALITY_ALLOCATORS.register("none")
@dataclass
class NoModalityAllocator(ModalityAllocator):
    """Modality-blind: all tokens compete for the head's budget."""

    def allocate(self, scores, counts, ctx):
        return None
