"""Channel pruners: the kept prompt keys stored with fewer channels (``model.compression.channels``).

A channel pruner runs after selection, on what the selector kept (merged entries included): for
every (sample, KV head) it picks the ``Dk`` key channels to keep, ``[B, Hkv, Dk]`` ascending, and
the layer stores that head's kept prompt keys as ``[n, Dk]`` rows (values keep every channel; the
layout and decode attention are :mod:`kvlab.cache.pruned`). A decode query attends the pruned keys
with its own matching channels, ``q_sel . k_sel`` at the model's scaling ``1 / sqrt(D)``: exactly
the attention over the full keys with the pruned channels set to zero. Tokens decoded afterwards
keep every channel. The kind composes with any token eviction (it only changes how the kept keys
are stored); ``docs/methods/think.md`` lists what it is refused with.

- ``think`` (Xu et al. 2024, Sec. 3, the query-driven criterion): per KV head, channel ``i``
  scores ``||Q_w[:, i] K[:, i]^T||_F = ||Q_w[:, i]|| * ||K[:, i]||`` (the outer product of two
  vectors has rank one), with ``Q_w`` the last ``window`` queries of the prompt (every
  query head of the KV head's group stacked) and ``K`` the head's kept keys; the ``Dk`` largest
  are kept.
- ``key_magnitude``: query-agnostic. Channel ``i`` scores ``||K[:, i]||`` alone: ThinK's criterion
  without the query factor (magnitude pruning of the key channels), the baseline that shows what
  the window's queries add.

``Dk = ceil(keep * D)`` (``keep * D`` rounded to 6 decimals first, so ``0.3 * 10`` keeps 3):
kvpress's ``ThinKPress`` prunes ``int(D * ratio)`` channels, the same count for ``ratio = 1 - keep``.
Ties go to the lower channel (a stable sort).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext, check_observed_window
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry


class ChannelPruner(Component):
    """Base class: :meth:`channel_scores` rates every key channel of every (sample, KV head);
    :meth:`channels` (the pipeline's entry point) keeps the :meth:`kept_channels` best.

    ``keep``: the share of a head's ``D`` key channels kept, in (0, 1] (1 keeps them all: the
    layer then stores every channel through the pruned layout, which attends exactly as the
    unpruned one). Capabilities: the kind's default (a pruner reads the kept keys and at most the
    recent window's queries, which every prefill schedule holds).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    keep: float = 0.5

    def check_keep(self) -> None:
        """Refuse a ``keep`` outside (0, 1] (the registry turns the ValueError into a ConfigError)."""
        if not 0 < self.keep <= 1:
            raise ValueError(
                f"{self.registry_name}: keep is the share of key channels kept, in (0, 1]; got {self.keep}"
            )

    def kept_channels(self, head_dim: int) -> int:
        """``Dk``: channels kept of ``head_dim`` (:func:`kept_channel_count`)."""
        return kept_channel_count(self.keep, head_dim)

    def channel_scores(self, ctx: LayerContext, keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, D]`` fp32, higher is kept.

        Args:
            ctx: the layer's context (its window queries).
            keys: ``[B, Hkv, K, D]`` the kept keys of each (sample, KV head) (post-RoPE, as stored).
            kept: ``[B, Hkv, K]`` bool, True on real entries (``K`` is the longest head's count).
        """
        raise NotImplementedError

    def channels(self, ctx: LayerContext, selection: Selection) -> torch.Tensor:
        """``[B, Hkv, Dk]`` long: the key channels each (sample, KV head) keeps, ascending."""
        keys, kept = kept_keys(ctx, selection)
        scores = self.channel_scores(ctx, keys, kept)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        return order[..., : self.kept_channels(keys.shape[-1])].sort(dim=-1).values


def kept_channel_count(keep: float, head_dim: int) -> int:
    """``Dk = ceil(keep * head_dim)``, at least 1 (``keep * head_dim`` rounded to 6 decimals first)."""
    return max(1, math.ceil(round(keep * head_dim, 6)))


CHANNEL_PRUNERS: Registry[ChannelPruner] = Registry("channel pruner", "model.compression.channels")


def kept_keys(ctx: LayerContext, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a selection keeps, ``[B, Hkv, K, D]`` fp32 (zero past each head's count), and the
    mask of real entries ``[B, Hkv, K]``: the selection's own keys (a merge selector's) or the
    layer's keys at the kept positions."""
    mask = selection.mask()
    if selection.keys is not None:
        keys = selection.keys.float()
    else:
        index = selection.indices[..., None].expand(-1, -1, -1, ctx.keys.shape[-1])
        keys = ctx.keys.gather(2, index).float()
    return keys * mask[..., None], mask


def squared_channel_norms(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_t valid[..., t] * x[..., t, i]^2`` over the rows ``t`` of ``x [..., T, D]`` -> ``[..., D]``
    fp32 (``valid [..., T]`` bool)."""
    x = x.float()
    return (x * x * valid[..., None]).sum(-2)


@CHANNEL_PRUNERS.register("think")
@dataclass
class ThinK(ChannelPruner):
    """ThinK's query-driven key channel pruning (Sec. 3): channel ``i`` of a KV head
    scores ``||Q_w[:, i]|| * ||K[:, i]||`` over the last ``window`` queries of its query group and
    its kept keys; the ``ceil(keep * D)`` best are kept.

    ``window`` restates ``budget.window``: inside a pipeline each sample observes the budget's
    window (a ratio window: each sample's own count), without a budget ``window`` must be written.
    A sample shorter than the window scores with its own real queries only (its padding queries
    count zero), so a padded batch equals each sample alone.
    """

    paper: ClassVar[str] = papers.THINK
    budget_settings: ClassVar[dict[str, str]] = {"window": "window"}
    keep: float = 0.5
    window: int | None = None

    def __post_init__(self) -> None:
        self.check_keep()
        check_observed_window(self.window)

    def channel_scores(self, ctx: LayerContext, keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        B, Hkv, _, D = keys.shape
        T = ctx.seq_len
        windows = ctx.observation_windows(self.window, "think (model.compression.channels)").clamp(max=T)
        widest = int(windows.max())
        queries = ctx.last_queries(widest, "think (model.compression.channels)")  # [B, H, W, D]
        # each sample's own window, its padding queries (a sample shorter than it) left out
        position = torch.arange(T - widest, T, device=windows.device)
        real = ctx.valid[:, T - widest :] & (position[None, :] >= T - windows[:, None])  # [B, W]
        query_norms = squared_channel_norms(queries, real[:, None, :]).view(B, Hkv, -1, D).sum(2)
        return (query_norms * squared_channel_norms(keys, kept)).sqrt()


@CHANNEL_PRUNERS.register("key_magnitude")
@dataclass
class KeyMagnitude(ChannelPruner):
    """Query-agnostic magnitude pruning: channel ``i`` of a KV head scores ``||K[:, i]||`` over its
    kept keys (ThinK's criterion without the query factor); the ``ceil(keep * D)`` largest are kept."""

    keep: float = 0.5

    def __post_init__(self) -> None:
        self.check_keep()

    def channel_scores(self, ctx: LayerContext, keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return squared_channel_norms(keys, kept).sqrt()
