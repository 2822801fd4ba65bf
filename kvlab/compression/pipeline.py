"""Pipeline: the compression method of a run, assembled from registry components by YAML.

Schema of ``model.compression`` (every field optional; no scorer at all means the full cache)::

    budget: {tokens: 128, window: 32, sinks: 0}      # or {ratio: 0.2, ...}; see budget.py
    importance: [{name: window_attention, window: 32, kernel: 5, pool: avg}]
    diversity: []                                    # e.g. [{name: keydiff}]
    mixer: {name: weighted_sum}                      # how importance and diversity combine
    allocate:
      layer: {name: uniform}                         # or pyramid
      head: {name: uniform}
      modality: {name: none}
    select: {name: topk}
    decode: {name: none}                             # decode-time policy

One layer's compression (:meth:`Pipeline.compress`):

1. per-sample budget (protected included) -> layer allocator -> this layer's budget ``[B]``;
2. samples whose budget covers their prompt keep everything;
3. importance and diversity scores ``[B, Hkv, T]`` -> mixer -> one score;
4. protected tokens (window, sinks) are taken out; the head allocator splits the remaining
   budget across KV heads ``[B, Hkv]`` (ragged allowed);
5. the modality allocator may split each head's budget by modality;
6. the selector picks the tokens (protected ones always in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.compression.allocators import HEAD_ALLOCATORS, LAYER_ALLOCATORS, MODALITY_ALLOCATORS
from kvlab.compression.budget import Budget
from kvlab.compression.context import LayerContext
from kvlab.compression.decode import DECODE_POLICIES, DecodePolicy
from kvlab.compression.diversity import DIVERSITY
from kvlab.compression.importance import IMPORTANCE, WindowAttentionScorer
from kvlab.compression.mixers import MIXERS
from kvlab.compression.selectors import SELECTORS, Selection
from kvlab.errors import ConfigError, did_you_mean
from kvlab.registry import to_plain

WHERE = "model.compression"
FIELDS = ("budget", "importance", "diversity", "mixer", "allocate", "select", "decode", "schedule")
ALLOCATE_FIELDS = ("layer", "head", "modality")


def _check_fields(node: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in node:
        if key not in allowed:
            raise ConfigError(
                f"{where} has no field '{key}'.{did_you_mean(key, allowed)} "
                f"Its fields are: {', '.join(allowed)}."
            )


def _as_list(node: Any, where: str) -> list[Any]:
    if node is None:
        return []
    if isinstance(node, list):
        return node
    if isinstance(node, dict | str):
        return [node]
    raise ConfigError(f"{where} must be a list of components ({{name: ...}} mappings), got {node!r}.")


@dataclass
class LayerReport:
    """What one layer's compression did, for predictions and TensorBoard.

    ``kept`` is ``[B, Hkv]`` (tokens kept per head), ``budget`` the layer budget ``[B]``,
    ``selection`` which positions were kept, and ``scores`` the mixed ``[B, Hkv, T]`` score (only
    when the pipeline is asked to record scores).
    """

    layer_idx: int
    kept: torch.Tensor
    budget: torch.Tensor
    selection: Selection | None = None
    seconds: float = 0.0
    scores: torch.Tensor | None = None


@dataclass
class Pipeline:
    """A compression method built from YAML. ``Pipeline.from_config(node)`` validates everything."""

    budget: Budget | None
    importance: list[Any] = field(default_factory=list)
    diversity: list[Any] = field(default_factory=list)
    mixer: Any = None
    layer_allocator: Any = None
    head_allocator: Any = None
    modality_allocator: Any = None
    selector: Any = None
    decode_policy: DecodePolicy | None = None
    schedule: str = "layerwise"

    @classmethod
    def from_config(cls, node: Any) -> Pipeline:
        """Build and validate a pipeline from a ``model.compression`` node (None means full cache)."""
        node = to_plain(node) or {}
        if not isinstance(node, dict):
            raise ConfigError(f"{WHERE} must be a mapping (see docs/architecture.md), got {node!r}.")
        _check_fields(node, FIELDS, WHERE)
        allocate = node.get("allocate") or {}
        if not isinstance(allocate, dict):
            raise ConfigError(f"{WHERE}.allocate must be a mapping with keys {', '.join(ALLOCATE_FIELDS)}.")
        _check_fields(allocate, ALLOCATE_FIELDS, f"{WHERE}.allocate")
        schedule = node.get("schedule", "layerwise")
        if schedule != "layerwise":
            raise ConfigError(
                f"{WHERE}.schedule '{schedule}' is not supported yet; use 'layerwise' (compress each layer "
                "right after its prefill attention)."
            )
        importance = [
            IMPORTANCE.build(n, f"{WHERE}.importance[{i}]")
            for i, n in enumerate(_as_list(node.get("importance"), f"{WHERE}.importance"))
        ]
        diversity = [
            DIVERSITY.build(n, f"{WHERE}.diversity[{i}]")
            for i, n in enumerate(_as_list(node.get("diversity"), f"{WHERE}.diversity"))
        ]
        compresses = bool(importance or diversity)
        if compresses and node.get("budget") is None:
            raise ConfigError(
                f"{WHERE}.budget is missing: a pipeline with scorers needs a budget, e.g. "
                "`budget: {tokens: 128, window: 32}` or `budget: {ratio: 0.2, window: 32}`."
            )
        budget = Budget.from_config(node["budget"]) if node.get("budget") is not None else None
        pipeline = cls(
            budget=budget,
            importance=importance,
            diversity=diversity,
            mixer=MIXERS.build(node.get("mixer") or "weighted_sum", f"{WHERE}.mixer"),
            layer_allocator=LAYER_ALLOCATORS.build(
                allocate.get("layer") or "uniform", f"{WHERE}.allocate.layer"
            ),
            head_allocator=HEAD_ALLOCATORS.build(allocate.get("head") or "uniform", f"{WHERE}.allocate.head"),
            modality_allocator=MODALITY_ALLOCATORS.build(
                allocate.get("modality") or "none", f"{WHERE}.allocate.modality"
            ),
            selector=SELECTORS.build(node.get("select") or "topk", f"{WHERE}.select"),
            decode_policy=DECODE_POLICIES.build(node.get("decode") or "none", f"{WHERE}.decode"),
            schedule=schedule,
        )
        pipeline._check_window()
        return pipeline

    def _check_window(self) -> None:
        """SnapKV-style scorers always keep their observation window: it must fit in the budget."""
        if self.budget is None or self.budget.tokens is None:
            return
        for i, scorer in enumerate(self.importance):
            if isinstance(scorer, WindowAttentionScorer) and scorer.window > self.budget.tokens:
                raise ConfigError(
                    f"{WHERE}.importance[{i}].window = {scorer.window} is larger than the budget "
                    f"({WHERE}.budget.tokens = {self.budget.tokens}); the observation window is always kept. "
                    "Lower the window or raise the budget."
                )

    def components(self) -> list[Any]:
        """Every configured component (scorers, mixer, allocators, selector, decode policy)."""
        parts = [*self.importance, *self.diversity, self.mixer, self.layer_allocator, self.head_allocator]
        return [*parts, self.modality_allocator, self.selector, self.decode_policy]

    def bind_model(self, model: str) -> None:
        """Tell components that load per-model artefacts which model runs; fails fast on a mismatch.

        Called before the model loads (``KVLabModule``) and again by ``generate`` (idempotent).
        """
        if getattr(self, "_bound_model", None) == model:
            return
        for component in self.components():
            if hasattr(component, "bind_model"):
                component.bind_model(model)
        self._bound_model = model

    @property
    def compresses(self) -> bool:
        """False for the full cache (no scorer configured)."""
        return bool(self.importance or self.diversity)

    def compress(self, ctx: LayerContext, record_scores: bool = False) -> tuple[Selection, LayerReport]:
        """Choose what layer ``ctx.layer_idx`` keeps. See the module docstring for the steps."""
        lengths = ctx.lengths
        valid = ctx.valid
        if not self.compresses:
            keep_all = valid[:, None, :].expand(-1, ctx.num_kv_heads, -1)
            counts = lengths[:, None].expand(-1, ctx.num_kv_heads).clone()
            scores = torch.where(keep_all, 0.0, float("-inf"))
            selection = self.selector.select(scores, counts, ctx)
            return selection, LayerReport(ctx.layer_idx, counts, lengths.clone(), selection)

        budget = self.budget.per_sample(lengths)
        protected_counts = self.budget.protected_counts(lengths)
        layer_budget = self.layer_allocator.allocate(budget, lengths, protected_counts, ctx)
        layer_budget = torch.clamp(torch.as_tensor(layer_budget, device=lengths.device), min=protected_counts)

        protected = self.budget.protected_mask(valid)  # [B, T]
        ctx.protected = protected
        importance = [scorer.score(ctx) for scorer in self.importance]
        diversity = [scorer.score(ctx) for scorer in self.diversity]
        mixed = self.mixer.mix(importance, diversity, ctx).float()  # [B, Hkv, T]

        candidates = (valid & ~protected)[:, None, :]
        candidate_scores = mixed.masked_fill(~candidates, float("-inf"))
        available = candidates.sum(-1)  # [B, 1]
        free = layer_budget - protected_counts
        signal = candidate_scores
        if self.head_allocator.signal == "importance" and importance:
            signal = importance[0].float().masked_fill(~candidates, float("-inf"))
        head_counts = self.head_allocator.allocate(signal, free, ctx)
        head_counts = torch.minimum(torch.clamp(head_counts, min=0), available)
        uncompressed = layer_budget >= lengths  # [B]
        head_counts = torch.where(uncompressed[:, None], available, head_counts)

        quota = self.modality_allocator.allocate(candidate_scores, head_counts, ctx)
        if quota is not None:
            raise ConfigError("modality quotas need a modality-aware selector (coming with DAVID/LOOK-M)")

        final = candidate_scores.masked_fill(protected[:, None, :], float("inf"))
        counts = head_counts + protected_counts[:, None]
        selection = self.selector.select(final, counts, ctx)
        report = LayerReport(
            ctx.layer_idx, selection.counts, layer_budget, selection, scores=mixed if record_scores else None
        )
        return selection, report
