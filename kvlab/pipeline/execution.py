"""One layer's compression by a :class:`~kvlab.pipeline.spec.Pipeline` (the steps of its docstring).

:class:`LayerExecution` is a mixin of the pipeline: :meth:`LayerExecution.compress` chooses what a
layer keeps (budget -> layer allocator -> scores -> mix -> head and modality allocators ->
selector -> decode policy hook -> how the cache stores it: quantizer, channel pruner) and
:meth:`LayerExecution.observe` is the first half of it under
``schedule: global`` (everything that reads the layer's queries, kept until every layer has been
observed). Routed pipelines go through :class:`~kvlab.pipeline.routed.RoutedExecution`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.decision import RouteDecision
from kvlab.compression.modality import group_topk_mask
from kvlab.pipeline.report import LayerReport


@dataclass
class Observations:
    """What one pipeline node saw of a run's layers, kept in the run state (``ctx.run.owned(node, ...)``).

    Attributes:
        scores: ``schedule: global``: each observed layer's scores by role and their fp32 mix
            (``[B, Hkv, T]`` each), by layer index, until the layer is compressed (handed over once).
        decisions: a route's decision for each layer, by layer index (a route node only).
    """

    scores: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    decisions: dict[int, RouteDecision] = field(default_factory=dict)


def overshoot(window: torch.Tensor, counts: torch.Tensor, layer_budget: torch.Tensor) -> torch.Tensor:
    """Tokens per head a sample keeps beyond its asked budget at one layer, ``[B]``: the larger of
    ``window`` (``[B]``, :meth:`Budget.overshoot <kvlab.compression.budget.Budget.overshoot>`: its
    protected tokens do not fit) and the mean over KV heads of ``counts [B, Hkv]`` beyond the
    layer budget ``[B]`` (a component keeping more than it was given: e.g. ``text_prior`` with
    ``overflow: keep_all_text``), rounded down to whole tokens."""
    heads = counts.shape[1]
    excess = torch.div(counts.sum(-1) - layer_budget.to(counts.dtype) * heads, heads, rounding_mode="floor")
    return torch.maximum(window.to(excess.dtype), excess.clamp(min=0))


def within_window(ctx: LayerContext) -> LayerContext:
    """``ctx`` with only the prompt tokens the layer's next query sees left valid: the last
    ``sliding_window - 1`` of the padded row (left padding: each sample's own last tokens)."""
    T = ctx.valid.shape[1]
    visible = torch.arange(T, device=ctx.valid.device) >= T - (ctx.sliding_window - 1)
    return ctx.restricted(ctx.valid & visible)


class LayerExecution:
    """Mixin of :class:`~kvlab.pipeline.spec.Pipeline`: one layer's observation and compression."""

    def observe(self, ctx: LayerContext) -> None:
        """``schedule: global``, during the prefill of layer ``ctx.layer_idx``: everything that reads
        its queries, kept in the run state (:class:`Observations`) for :meth:`compress` after the
        last layer.

        The route decision (per branch taken: that branch's observation), the budget's protected
        tokens, every scorer's score ``[B, Hkv, T]`` and the mix, then the layer allocator's
        ``observe(ctx, scores, mixed)`` hook when it declares ``observes_layers`` (how
        ``prefix_threshold`` sees every layer). A sliding-window layer kept whole
        (``sliding_layers: window``) observes nothing and is recorded in the run state
        (:meth:`~kvlab.cache.state.RunState.keep_whole`).
        """
        if ctx.sliding_window is not None:
            ctx = within_window(ctx)
            if self.sliding_layers == "window":
                ctx.run.keep_whole(ctx.layer_idx)
                return
        self._observe(ctx)

    def _observe(self, ctx: LayerContext) -> None:
        if self.route_rule is not None:
            self._observe_routed(ctx)
            return
        if not self.compresses:
            return
        self._protect(ctx)
        scores, mixed = self._score(ctx)
        ctx.run.owned(self, Observations).scores[ctx.layer_idx] = (scores, mixed)
        if self.layer_allocator.capabilities.observes_layers:
            self.layer_allocator.observe(ctx, scores, mixed)

    def _score(self, ctx: LayerContext) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every scorer's ``[B, Hkv, T]`` score by role and their fp32 mix ``[B, Hkv, T]``: the ones
        :meth:`observe` kept for this layer (``schedule: global``, handed over once), else computed."""
        held = ctx.run.owned(self, Observations).scores.pop(ctx.layer_idx, None)
        if held is not None:
            return held
        scores = {
            role: scorer.score(ctx) for role, scorer in [*self.importance.items(), *self.diversity.items()]
        }
        return scores, self.mixer.mix(scores, ctx).float()

    def compress(self, ctx: LayerContext, record_scores: bool = False) -> tuple[Selection, LayerReport]:
        """Choose what layer ``ctx.layer_idx`` keeps. See the module docstring for the steps
        (``schedule: global``: after :meth:`observe` saw every layer)."""
        if ctx.sliding_window is not None:
            ctx = within_window(ctx)
            if self.sliding_layers == "window":
                selection, report = self._keep_all(ctx)
                self.decode_policy.on_compress(ctx, selection, report.budget)
                return self._stored(ctx, selection), report
        selection, report = self._select(ctx, record_scores)
        self.decode_policy.on_compress(ctx, selection, report.budget)
        return self._stored(ctx, selection), report

    def _stored(self, ctx: LayerContext, selection: Selection) -> Selection:
        """``selection`` carrying how the cache stores it: the pipeline's quantizer (step 8), which the
        cache applies, and each (sample, KV head)'s kept key channels (step 9), chosen here from the
        kept keys (a merge selector's own) and the layer's window queries."""
        if self.quantizer is not None:
            selection = dataclasses.replace(selection, quantizer=self.quantizer)
        if self.channel_pruner is not None:
            if ctx.window is None and self.budget is not None:  # a layer kept whole observes the budget's too
                ctx.window = self.budget.window_counts(ctx.lengths)
            selection = dataclasses.replace(selection, channels=self.channel_pruner.channels(ctx, selection))
        return selection

    def _keep_all(self, ctx: LayerContext) -> tuple[Selection, LayerReport]:
        """Keep every valid token of the layer (the full cache): each scored ``+inf``, as a protected
        token, so a selector that keeps by score (``threshold``) keeps them too."""
        keep_all = ctx.valid[:, None, :].expand(-1, ctx.num_kv_heads, -1)
        counts = ctx.lengths[:, None].expand(-1, ctx.num_kv_heads).clone()
        scores = torch.where(keep_all, float("inf"), float("-inf"))
        selection = self.selector.select(scores, counts, ctx)
        return selection, LayerReport(ctx.layer_idx, counts, ctx.lengths.clone(), selection)

    def _select(self, ctx: LayerContext, record_scores: bool) -> tuple[Selection, LayerReport]:
        if self.route_rule is not None:
            return self._select_routed(ctx, record_scores)
        lengths = ctx.lengths
        valid = ctx.valid
        if not self.compresses:
            return self._keep_all(ctx)

        budget = self.budget.per_sample(lengths)
        protected_counts = self.budget.protected_counts(lengths)
        layer_budget = self.layer_allocator.allocate(budget, lengths, protected_counts, ctx)
        layer_budget = torch.clamp(torch.as_tensor(layer_budget, device=lengths.device), min=protected_counts)

        protected = self._protect(ctx)  # [B, T]
        scores, mixed = self._score(ctx)  # by role, and mixed [B, Hkv, T]
        ctx.role_scores = scores  # a selector may rank by one role (two_stage)

        candidates = (valid & ~protected)[:, None, :]
        candidate_scores = mixed.masked_fill(~candidates, float("-inf"))
        available = candidates.sum(-1)  # [B, 1]
        free = layer_budget - protected_counts
        signal = candidate_scores
        if self.head_allocator.signal != "mixed":
            signal = scores[self.head_allocator.signal].float().masked_fill(~candidates, float("-inf"))
        head_counts = self.head_allocator.allocate(signal, free, ctx)
        head_counts = torch.minimum(torch.clamp(head_counts, min=0), available)
        uncompressed = layer_budget >= lengths  # [B]
        head_counts = torch.where(uncompressed[:, None], available, head_counts)

        quota = self.modality_allocator.allocate(candidate_scores, head_counts, ctx)
        if quota is not None:  # keep exactly the per-group top candidates
            chosen = group_topk_mask(candidate_scores, quota.groups, quota.quota)
            head_counts = chosen.sum(-1)
            candidate_scores = torch.where(chosen, float("inf"), float("-inf"))

        final = candidate_scores.masked_fill(protected[:, None, :], float("inf"))
        counts = head_counts + protected_counts[:, None]
        selection = self.selector.select(final, counts, ctx)
        report = LayerReport(
            ctx.layer_idx,
            selection.counts,
            layer_budget,
            selection,
            scores=mixed if record_scores else None,
            overshoot=overshoot(self.budget.overshoot(lengths), selection.counts, layer_budget),
        )
        if record_scores:  # each scorer's own score by role, candidates only
            report.scorer_scores = {
                role: score.float().masked_fill(~candidates, float("-inf")) for role, score in scores.items()
            }
        return selection, report

    def _protect(self, ctx: LayerContext) -> torch.Tensor:
        """Set the budget's recent window ``[B]`` and protected tokens ``[B, T]`` on ``ctx``; return these."""
        ctx.window = self.budget.window_counts(ctx.lengths)
        ctx.protected = self.budget.protected_mask(ctx.valid)
        return ctx.protected
