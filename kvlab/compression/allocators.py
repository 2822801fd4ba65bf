"""Budget allocators: per layer, per head, per modality.

- A layer allocator turns the per-head budget of each sample into this layer's per-head budget.
- A head allocator splits a layer's free budget (budget minus protected tokens) among KV heads.
- A modality allocator (slot; ``none`` today) may split a head's budget across modalities.

All budgets count tokens per KV head; protected tokens are inside the layer budget.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from kvlab.compression.context import LayerContext
from kvlab.config import papers
from kvlab.config.artefacts import UsesArtefact
from kvlab.config.capabilities import Component
from kvlab.config.errors import ConfigError
from kvlab.config.registry import Registry


class LayerAllocator(Component):
    """Base class: override :meth:`allocate` (and :meth:`observe` when it declares
    ``observes_layers``)."""

    def observe(self, ctx: LayerContext, scores: dict[str, torch.Tensor], mixed: torch.Tensor) -> None:
        """``schedule: global``: see layer ``ctx.layer_idx``'s scores by role and their mix
        (``[B, Hkv, T]`` each) before any layer is compressed. Called only when the allocator
        declares ``Capabilities(observes_layers=True)``."""
        return None

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


class HeadAllocator(Component):
    """Base class: override :meth:`allocate`.

    ``signal`` says which score the allocator compares across heads: ``mixed`` (the pipeline's
    final score) or the role of one scorer (its key under ``importance`` or ``diversity``), e.g.
    ``attention``: SnapKV's pooled window attention ``s_ex`` when MixKV mixes in diversity, as
    the MixKV release allocates AdaKV budgets (``docs/methods/mixkv.md``).
    """

    signal: str = "mixed"

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


class ModalityAllocator(Component):
    """Base class: override :meth:`allocate` (returns None for a unified, modality-blind budget)."""

    def allocate(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> torch.Tensor | None:
        """A :class:`~kvlab.compression.modality.ModalityQuota` (groups ``[B, T]``, quotas
        ``[B, Hkv, G]``), or None for a modality-blind budget (see ``modality.py``)."""
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

    paper: ClassVar[str | None] = papers.PYRAMIDKV

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


def layer_signal(signal: str, scores: dict[str, torch.Tensor], mixed: torch.Tensor) -> torch.Tensor:
    """The score a layer allocator observes: ``mixed`` (the pipeline's mixed score) or the scorer
    of role ``signal`` (``[B, Hkv, T]``). The pipeline refuses an unknown role when it is built; this
    refuses it for a direct call."""
    if signal == "mixed":
        return mixed
    if signal not in scores:
        raise ConfigError(
            f"model.compression.allocate.layer.signal = '{signal}' is not a scorer's role "
            f"({', '.join(scores)}); write `signal: mixed` or the key of the scorer to allocate from."
        )
    return scores[signal]


def require_every_layer(observed: Sized, ctx: Any, name: str, what: str, other_fix: str = "") -> None:
    """Refuse to allocate before every compressed layer was observed: a layer allocator comparing
    ``what`` across layers (``observed``: one entry per observed layer) can allocate only after the
    last layer's prefill, i.e. under ``schedule: global``. The pipeline refuses another schedule
    when it is built (``comparing_layers``); this guards a direct call."""
    if len(observed) + len(ctx.run.whole_layers) != ctx.num_layers:
        raise ConfigError(
            f"model.compression.allocate.layer '{name}' compares {what} of every layer, known only after "
            f"the last layer's prefill: set `model.compression.schedule: global`{other_fix}."
        )


def round_to_total(real: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative ``real`` (any shape) to integers summing to ``total`` (largest remainder).

    Each entry is its floor or its ceiling; ties in the remainder go to the lower flat index.
    """
    flat = real.reshape(-1).double()
    base = torch.floor(flat)
    short = int(total - base.sum().item())
    if short > 0:
        order = torch.sort(flat - base, descending=True, stable=True).indices[:short]
        base[order] += 1
    return base.long().view(real.shape)


@HEAD_ALLOCATORS.register("adakv")
@dataclass
class AdaKVHeadAllocator(HeadAllocator):
    """AdaKV (Feng et al. 2025): heads of a layer compete for the layer's budget.

    Per sample, with ``B'`` the free budget per head and ``P`` the candidate tokens, over the
    ``signal`` scores ``[Hkv, P]``:

    - ``variant: linear_mix`` (the original ``AdaptiveSnapKVCluster``): sort each head's scores
      (``normalize`` multiplies head h's by ``sum(top-B') / sum(all)``), take the global top
      ``Hkv B'`` of the flattened layer, count winners per head ``c_h``, and keep
      ``c_h (1 - alpha) + alpha B'`` tokens. ``rounding: nearest`` is the released code's
      ``round(c_h (1 - alpha) + floor(alpha B'))`` (the total may miss ``Hkv B'`` by up to
      1.5 per head); ``exact_total`` (default) rounds the same real numbers by largest
      remainder so the layer keeps exactly ``Hkv B'`` (each head within one token of it).
    - ``variant: guarantee_topk`` (kvpress ``AdaKVPress``): every head keeps its top
      ``floor(alpha B')`` first; the rest of ``Hkv B'`` goes to a global competition.
      kvpress only masks the evicted keys; kvlab stores the ragged result, so memory falls.

    Both coincide at ``alpha = 0`` (pure global top-k) and ``alpha = 1`` (uniform). Layers
    below ``skip`` are uniform. Ties go to the lower (head, rank) index. ``signal`` is
    ``mixed`` (default: the pipeline's final score) or a scorer's role (the AdaKV and MixKV
    presets allocate from ``attention``, the window attention).

    Returns ``[B, Hkv]`` ragged counts.
    """

    paper: ClassVar[str | None] = papers.ADAKV

    alpha: float = 0.2
    variant: Literal["linear_mix", "guarantee_topk"] = "linear_mix"
    normalize: bool = False
    rounding: Literal["exact_total", "nearest"] = "exact_total"
    skip: int = 0
    signal: str = "mixed"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def allocate(self, scores, free, ctx):
        Hkv = ctx.num_kv_heads
        counts = free[:, None].expand(-1, Hkv).clone()
        if ctx.layer_idx < self.skip:
            return counts
        candidates = (scores > float("-inf")).sum(-1).amax(-1)  # [B]
        for b in range(scores.shape[0]):
            P, budget = int(candidates[b]), int(free[b])
            if budget >= P or budget <= 0:
                continue
            counts[b] = self._allocate_one(scores[b], budget, P)
        return counts

    def _allocate_one(self, scores: torch.Tensor, budget: int, P: int) -> torch.Tensor:
        """One sample: ``scores [Hkv, T]`` (-inf on non-candidates), ``0 < budget < P`` -> ``[Hkv]``."""
        Hkv = scores.shape[0]
        ranked = torch.sort(scores.double(), dim=-1, descending=True, stable=True).values[:, :P]  # [Hkv, P]
        floor = int(self.alpha * budget)
        if self.variant == "guarantee_topk":
            ranked = ranked.clone()
            ranked[:, :floor] = float("inf")
            return self._global_winners(ranked, Hkv * budget)
        if self.normalize:
            ranked = ranked * (ranked[:, :budget].sum(-1, keepdim=True) / ranked.sum(-1, keepdim=True))
        winners = self._global_winners(ranked, Hkv * budget).double()
        if self.rounding == "nearest":
            return torch.round(winners * (1 - self.alpha) + floor).long()
        return round_to_total(winners * (1 - self.alpha) + self.alpha * budget, Hkv * budget)

    @staticmethod
    def _global_winners(ranked: torch.Tensor, k: int) -> torch.Tensor:
        """Per-head counts of the global top ``k`` of ``ranked [Hkv, P]`` (ties: lower flat index)."""
        Hkv, P = ranked.shape
        order = torch.sort(ranked.reshape(-1), descending=True, stable=True).indices[:k]
        return torch.bincount(order // P, minlength=Hkv)


class StaticHeadAllocator(HeadAllocator, UsesArtefact):
    """Base of the static, model-wide head budgets from calibrated per-head scores (SparseMM,
    HeadKV): every KV head gets a guaranteed share of the free budget plus a share of a pool
    spread by its score. Subclasses give :meth:`shares` (how the ``[L, H]`` scores become shares
    summing to 1) and :meth:`min_cache` (the guaranteed free tokens of a head)::

        s = shares(scores)                           # [L, H], sums to 1 over the model
        s_kv[l, j] = gqa_j(s[l, j G : (j + 1) G])    # sum (default) or mean over the group
        remain = (B' - min_cache(B')) L Hkv
        cap[l, j] = s_kv[l, j] remain + min_cache(B')  # rounded (``rounding``)

    The allocation is prompt-independent; the total over the model is ``L Hkv B'``.
    ``rounding: exact_total`` (default) rounds by largest remainder so the total is exact (with
    ``gqa: mean`` the caps are first rescaled to that total); ``nearest`` is the released codes'
    ``round``. A cap above a head's candidate count is clamped (the released codes silently
    truncate; kvlab's per-head kept counts in the predictions show it). ``artefact: auto`` finds
    the model's artefact in ``$KVLAB_CACHE/calibration`` or among the shipped ones. The artefact's
    tensor is ``scores [L, H]``. Returns ``[B, Hkv]`` ragged counts.
    """

    artefact: str = "auto"
    gqa: Literal["sum", "mean"] = "sum"
    rounding: Literal["exact_total", "nearest"] = "exact_total"

    def __post_init__(self) -> None:
        self._caps: dict[int, torch.Tensor] = {}

    def shares(self, head_scores: torch.Tensor) -> torch.Tensor:
        """``[L, H]`` fp64 shares summing to 1 from the artefact's ``head_scores [L, H]``."""
        total = head_scores.double().sum()
        if not total > 0:
            raise ConfigError(
                f"{self._where()}: the head scores are all zero (no answer token attended to its target "
                "during calibration), so they cannot skew budgets. Calibrate on more samples."
            )
        return head_scores.double() / total

    def min_cache(self, budget: int) -> int:
        """The free tokens every head keeps whatever its score, for a free budget ``budget``."""
        raise NotImplementedError

    def capacities(self, head_scores: torch.Tensor, num_kv_heads: int, budget: int) -> torch.Tensor:
        """``[L, Hkv]`` free-token caps for a free budget ``budget`` from ``head_scores [L, H]``."""
        L, H = head_scores.shape
        if budget <= 0:
            return torch.zeros(L, num_kv_heads, dtype=torch.long, device=head_scores.device)
        s = self.shares(head_scores)
        grouped = s.view(L, num_kv_heads, H // num_kv_heads)
        s_kv = grouped.sum(-1) if self.gqa == "sum" else grouped.mean(-1)
        min_cache = self.min_cache(budget)
        remain = (budget - min_cache) * L * num_kv_heads
        real = s_kv * remain + min_cache
        if self.rounding == "nearest":
            return torch.round(real).long()
        return round_to_total(real * (L * num_kv_heads * budget) / real.sum(), L * num_kv_heads * budget)

    def allocate(self, scores, free, ctx):
        head_scores = self.artefact_for(ctx).tensors["scores"]
        counts = torch.empty(scores.shape[0], ctx.num_kv_heads, dtype=torch.long, device=scores.device)
        for b, budget in enumerate(free.tolist()):
            if budget not in self._caps:
                self._caps[budget] = self.capacities(head_scores, ctx.num_kv_heads, budget)
            counts[b] = self._caps[budget][ctx.layer_idx].to(scores.device)
        return counts


@HEAD_ALLOCATORS.register("sparsemm")
@dataclass
class SparseMMHeadAllocator(StaticHeadAllocator):
    """SparseMM (Wang et al. 2025): static head budgets skewed to offline "visual heads".

    From a ``visual_heads`` calibration artefact (``scores [L, H]``, mean over calibration
    samples; see docs/calibration.md), with ``B'`` the free budget per head, the
    :class:`StaticHeadAllocator` rule with ``s = scores / scores.sum()`` (over all ``L H`` query
    heads) and ``min_cache = floor(ratio B')``: 10% of every head's budget guaranteed by default,
    the rest spread over the model by the visual-head scores.

    Returns ``[B, Hkv]`` ragged counts.
    """

    paper: ClassVar[str | None] = papers.SPARSEMM

    artefact: str = "auto"
    ratio: float = 0.1
    gqa: Literal["sum", "mean"] = "sum"
    rounding: Literal["exact_total", "nearest"] = "exact_total"

    artefact_kind = "visual_heads"

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")
        super().__post_init__()

    def min_cache(self, budget: int) -> int:
        return int(budget * self.ratio)
