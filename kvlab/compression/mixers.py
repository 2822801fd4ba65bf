"""Mixers: combine the importance and diversity scores of a layer into one ``[B, Hkv, T]`` score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.registry import Registry


class Mixer:
    """Base class: override :meth:`mix`."""

    registry_name: str = ""

    def mix(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], ctx: LayerContext
    ) -> torch.Tensor:
        """Each input is ``[B, Hkv, T]``; return ``[B, Hkv, T]`` (higher means keep)."""
        raise NotImplementedError


MIXERS: Registry[Mixer] = Registry("mixer", "model.compression.mixer")


def minmax(scores: torch.Tensor, valid: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Min-max normalise ``[B, Hkv, T]`` scores per (sample, head) over finite valid positions.

    Non-finite entries (e.g. +inf on a protected window) are left as they are.
    """
    finite = torch.isfinite(scores) & valid[:, None, :]
    lo = scores.masked_fill(~finite, float("inf")).amin(-1, keepdim=True)
    hi = scores.masked_fill(~finite, float("-inf")).amax(-1, keepdim=True)
    normed = (scores - lo) / (hi - lo + eps)
    return torch.where(finite, normed, scores)


@MIXERS.register("weighted_sum")
@dataclass
class WeightedSumMixer(Mixer):
    """``s = sum_i w_i * s_i`` over importance then diversity scores (in YAML order).

    ``weights`` defaults to 1 for every score; ``normalize: minmax`` rescales each score to
    [0, 1] per (sample, head) first so scores of different scales can be mixed. A single score
    with the default settings passes through unchanged.
    """

    weights: tuple[float, ...] = ()
    normalize: Literal["none", "minmax"] = "none"

    def mix(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], ctx: LayerContext
    ) -> torch.Tensor:
        scores = importance + diversity
        weights = self.weights or (1.0,) * len(scores)
        if len(weights) != len(scores):
            raise ValueError(
                f"mixer 'weighted_sum' has {len(weights)} weights for {len(scores)} scores; "
                "give one weight per importance and diversity scorer"
            )
        if len(scores) == 1 and weights[0] == 1.0 and self.normalize == "none":
            return scores[0]
        total = torch.zeros_like(scores[0])
        for weight, score in zip(weights, scores, strict=True):
            part = minmax(score, ctx.valid) if self.normalize == "minmax" else score
            total = total + weight * part
        return total
