"""Routed execution: each layer's samples (or KV heads) sent to the branch a rule picks.

:class:`RoutedExecution` is a mixin of :class:`~kvlab.pipeline.spec.Pipeline` (the route's
parent node): the rule decides per sample (or per (sample, KV head) for a per-head rule), every
branch taken runs over the layer, and the branches' selections are combined row by row
(:func:`combine_selections`). The branches' components see the decision as ``ctx.route`` (and
a per-head branch its heads as ``ctx.routed_heads``, :meth:`LayerContext.in_branch
<kvlab.compression.context.LayerContext.in_branch>`); the route's decisions are kept per layer in
the run's :class:`~kvlab.pipeline.execution.Observations`, so under ``schedule: global`` the
decision made while observing a layer is reused when it is compressed.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.decision import RouteDecision
from kvlab.config.errors import ConfigError
from kvlab.pipeline.execution import Observations
from kvlab.pipeline.report import LayerReport


class RoutedExecution:
    """Mixin of :class:`~kvlab.pipeline.spec.Pipeline`: observation and compression through a route."""

    def _observe_routed(self, ctx: LayerContext) -> None:
        """``schedule: global``: the route's decision for layer ``ctx.layer_idx`` (kept for its
        compression) and the observation of every branch it took."""
        if self.budget is not None:
            self._protect(ctx)
        decisions = ctx.run.owned(self, Observations).decisions
        decision = decisions[ctx.layer_idx] = self.route_rule.decide(ctx)
        if decision.heads is None:
            for name in sorted(set(decision.branches)):
                with ctx.in_branch(decision, decisions):
                    self.branches[name]._observe(ctx)
            return
        heads = decision.heads.to(ctx.keys.device)
        for i in sorted(set(heads.flatten().tolist())):
            with ctx.in_branch(decision, decisions, heads == i):
                self.branches[decision.head_names[i]]._observe(ctx)

    def _select_routed(self, ctx: LayerContext, record_scores: bool) -> tuple[Selection, LayerReport]:
        """Run the branch each sample (each KV head, for a per-head rule) is routed to; combine the
        selections row by row."""
        if self.budget is not None:  # the rule's metric observes the parent budget's window
            self._protect(ctx)
        decisions = ctx.run.owned(self, Observations).decisions
        decision = decisions.get(ctx.layer_idx)  # schedule: global decided while observing
        if decision is None:
            decision = decisions[ctx.layer_idx] = self.route_rule.decide(ctx)
        if decision.heads is not None:
            return self._select_per_head(ctx, decision, decisions, record_scores)
        names = sorted(set(decision.branches))
        runs = []
        for name in names:
            with ctx.in_branch(decision, decisions):
                runs.append(self.branches[name]._select(ctx, record_scores))
        if len(runs) == 1:
            selection, report = runs[0]
        else:
            choice = torch.tensor([names.index(n) for n in decision.branches], device=ctx.keys.device)
            selection = combine_selections([s for s, _ in runs], choice, ctx)
            reports = [r for _, r in runs]
            report = LayerReport(
                ctx.layer_idx,
                selection.counts,
                pick_rows([r.budget for r in reports], choice),
                selection,
                scores=pick_rows([r.scores for r in reports], choice),
                overshoot=pick_rows([r.overshoot for r in reports], choice),
                scorer_scores=pick_scorer_scores([r.scorer_scores for r in reports], choice),
            )
        report.route = decision
        return selection, report

    def _select_per_head(
        self,
        ctx: LayerContext,
        decision: RouteDecision,
        decisions: dict[int, RouteDecision],
        record_scores: bool,
    ) -> tuple[Selection, LayerReport]:
        """Run every branch some KV head is routed to (each over the whole layer) and take each
        (sample, head) row from its own branch. The branches share the layer budget (checked when
        built), so the per-sample fields of the report come from any of them."""
        heads = decision.heads.to(ctx.keys.device)
        used = sorted(set(heads.flatten().tolist()))
        runs = []
        for i in used:
            with ctx.in_branch(decision, decisions, heads == i):
                runs.append(self.branches[decision.head_names[i]]._select(ctx, record_scores))
        selection, report = runs[0]
        if len(runs) > 1:
            choice = torch.searchsorted(torch.tensor(used, device=heads.device), heads)  # index into runs
            selection = combine_selections([s for s, _ in runs], choice, ctx)
            report = LayerReport(
                ctx.layer_idx,
                selection.counts,
                report.budget,
                selection,
                scores=pick_rows([r.scores for _, r in runs], choice),
                overshoot=report.overshoot,
                scorer_scores=pick_scorer_scores([r.scorer_scores for _, r in runs], choice),
            )
        report.route = decision
        return selection, report


def pick_rows(tensors: list[torch.Tensor | None], choice: torch.Tensor) -> torch.Tensor | None:
    """Row b of ``tensors[choice[b]]`` for every b (tensors share shapes; None if any is None).

    A ``[B, Hkv]`` choice (per-head routes) picks row ``(b, h)`` of tensors shaped ``[B, Hkv, ...]``.
    """
    if any(t is None for t in tensors):
        return None
    stacked = torch.stack(tensors)  # [branches, B, ...]
    rows = torch.arange(stacked.shape[1], device=stacked.device)
    choice = choice.to(stacked.device)
    if choice.dim() == 2:
        heads = torch.arange(stacked.shape[2], device=stacked.device)
        return stacked[choice, rows[:, None], heads[None, :]]
    return stacked[choice, rows]


def pick_scorer_scores(
    by_branch: list[dict[str, torch.Tensor] | None], choice: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """Each scorer role's ``[B, Hkv, T]`` scores, row b (or ``(b, h)``) from the branch ``choice``
    picks (:func:`pick_rows`); a row whose branch has no such role is ``-inf`` (no candidate there),
    so the scores keep marking only the candidates of the branch each row took. None when no branch
    recorded scores (``record_scores`` off)."""
    if all(scores is None for scores in by_branch):
        return None
    branches = [scores or {} for scores in by_branch]
    roles = dict.fromkeys(role for scores in branches for role in scores)
    out = {}
    for role in roles:
        shape = next(scores[role] for scores in branches if role in scores)
        rows = [scores.get(role, torch.full_like(shape, float("-inf"))) for scores in branches]
        out[role] = pick_rows(rows, choice)
    return out


def combine_selections(selections: list[Selection], choice: torch.Tensor, ctx: LayerContext) -> Selection:
    """One :class:`Selection` whose sample b (head ``(b, h)`` for a ``[B, Hkv]`` choice) comes from
    ``selections[choice[b]]``.

    Index lists are padded to the longest; when some branch merges (carries keys/values) the
    others' kept entries are gathered from the prefill K/V so every row has replacements. A
    branch's offloaded store (a retrieve selector) is kept for that branch's rows only
    (:func:`restrict_store`).
    """
    K = max(s.indices.shape[-1] for s in selections)
    merged = any(s.keys is not None for s in selections)
    indices, keys, values = [], [], []
    for s in selections:
        pad = K - s.indices.shape[-1]
        idx = torch.nn.functional.pad(s.indices, (0, pad))
        indices.append(idx)
        if merged:
            k, v = s.keys, s.values
            if k is None:
                gather = s.indices[..., None].expand(-1, -1, -1, ctx.keys.shape[-1])
                k, v = ctx.keys.gather(2, gather), ctx.values.gather(2, gather)
            keys.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
            values.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
    return Selection(
        indices=pick_rows(indices, choice),
        counts=pick_rows([s.counts for s in selections], choice),
        keys=pick_rows(keys, choice) if merged else None,
        values=pick_rows(values, choice) if merged else None,
        offloaded=restrict_store(selections, choice, ctx.num_kv_heads),
    )


def restrict_store(selections: list[Selection], choice: torch.Tensor, num_kv_heads: int) -> Any:
    """The offloaded store of the combined selection: the one branch's store, for its rows only.

    ``choice`` is ``[B]`` or ``[B, Hkv]`` (see :func:`combine_selections`). A store must offer
    ``restrict(keep [B, Hkv]) -> store | None`` (:class:`kvlab.compression.retrieval.ChunkStore`).

    Raises:
        ConfigError: more than one branch offloads K/V in the same layer.
    """
    stores = [(i, s.offloaded) for i, s in enumerate(selections) if s.offloaded is not None]
    if not stores:
        return None
    if len(stores) > 1:
        raise ConfigError(
            "model.compression.route: two branches offload K/V (retrieve selectors) in the same layer, "
            "which one layer's cache cannot hold; route the retrieving heads to one branch."
        )
    branch, store = stores[0]
    keep = choice == branch
    if keep.dim() == 1:
        keep = keep[:, None].expand(-1, num_kv_heads)
    return store.restrict(keep)
