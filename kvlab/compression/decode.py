"""Decode policies: what happens to the cache while tokens are generated.

The slot exists on every pipeline (``model.compression.decode``). ``none`` appends every
decoded token and never evicts (the default of SnapKV, LOOK-M's "look once", DAVID and the
papers). ``h2o`` holds each (sample, KV head) at its post-prefill size by evicting one entry per
step. A policy has three hooks, all optional:

- :meth:`DecodePolicy.on_compress` sees each layer's prefill selection (and its context), e.g.
  to seed per-entry scores; it may keep state in ``ctx.state`` (one prompt's scratch space);
- :meth:`DecodePolicy.start` runs once after prefill with the cache and that state;
- :meth:`DecodePolicy.after_step` runs after every decode step (the step's token is already in
  each layer's decode region). Evicting goes through
  :meth:`~kvlab.engine.cache.CompressedLayer.evict_one`, which moves the newest token into the victim's
  slot, so memory stays what was allocated and nothing is masked.

PrefixKV's one-token drop at a fixed index fits the same slot: a policy whose ``after_step``
picks the victim slot by index instead of by score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.ops import reduce_groups
from kvlab.config.registry import Registry


class DecodePolicy:
    """Base class: override :meth:`after_step` (and :meth:`on_compress` / :meth:`start` when needed)."""

    registry_name: str = ""

    def on_compress(self, ctx: LayerContext, selection: Any) -> None:
        """Called right after layer ``ctx.layer_idx`` chose its ``Selection``."""
        return None

    def start(self, cache: Any, state: dict[str, Any]) -> None:
        """Called once after prefill with the :class:`~kvlab.engine.cache.CompressedCache` and the state."""
        return None

    def after_step(self, cache: Any, step: int) -> None:
        """Called after every decode step with the :class:`~kvlab.engine.cache.CompressedCache`."""
        raise NotImplementedError


DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode policy", "model.compression.decode")


@DECODE_POLICIES.register("none")
@dataclass
class AppendOnly(DecodePolicy):
    """Append every decoded token; never evict."""

    def after_step(self, cache: Any, step: int) -> None:
        return None


@DECODE_POLICIES.register("h2o")
@dataclass
class H2ODecodePolicy(DecodePolicy):
    """H2O at decode (Zhang et al. 2023): evict one entry per step so every head keeps a fixed size.

    Each cached entry carries its accumulated attention ``s``: at prefill the column sum of the
    prompt attention over every prompt query (``cumulative_attention``, GQA-reduced with
    ``gqa``, gathered at the kept positions; a merged entry inherits its kept token's score),
    then ``s += p`` for every decode query, ``p`` its softmax over the head's cached entries
    (``[B, Hkv, n]``, query heads of a group reduced the same way). After each step the
    newest token is stored and the entry with the lowest ``s`` outside the ``recent`` newest
    positions is evicted (the oldest entry when everything is recent), so each (sample, head)
    stays at its post-prefill size. ``recent`` defaults to the pipeline's ``budget.window``.
    """

    recent: int = 32
    gqa: Literal["mean", "sum"] = "mean"

    def __post_init__(self) -> None:
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0, got {self.recent}")

    def on_compress(self, ctx: LayerContext, selection: Any) -> None:
        scores = reduce_groups(ctx.cumulative_attention(), ctx.num_kv_heads, self.gqa)  # [B, Hkv, T]
        mask = selection.mask()
        kept = scores.gather(-1, selection.indices)[mask]  # [N] in the cache's flat order
        ctx.state.setdefault("h2o_decode", {})[ctx.layer_idx] = (kept, selection.indices[mask])

    def start(self, cache: Any, state: dict[str, Any]) -> None:
        seeds = state.get("h2o_decode", {})
        for layer_idx, layer in enumerate(cache.layers):
            scores, positions = seeds[layer_idx]
            layer.track_attention(scores, positions, self.gqa)

    def after_step(self, cache: Any, step: int) -> None:
        for layer in cache.layers:
            scores, positions, valid = layer.entry_view()  # [B, Hkv, S]; slot S-1 is the newest token
            newest = layer.cumulative_length - 1
            recent = positions > newest - self.recent
            candidate = valid & ~recent
            lowest = scores.masked_fill(~candidate, float("inf")).argmin(-1)
            oldest = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argmin(-1)
            layer.evict_one(torch.where(candidate.any(-1), lowest, oldest))
