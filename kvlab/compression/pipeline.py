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
    route:                                           # optional: per-layer branches (see routing.py)
      rule: {name: latch, metric: {name: ncar}, before: decoupled, after: unified}
      branches: {decoupled: {allocate: {modality: {name: decoupled}}}, unified: {}}

One layer's compression (:meth:`Pipeline.compress`):

1. per-sample budget (protected included) -> layer allocator -> this layer's budget ``[B]``;
2. samples whose budget covers their prompt keep everything;
3. importance and diversity scores ``[B, Hkv, T]`` -> mixer -> one score;
4. protected tokens (window, sinks) are taken out; the head allocator splits the remaining
   budget across KV heads ``[B, Hkv]`` (ragged allowed);
5. the modality allocator may split each head's budget by modality (text / vision groups):
   the top candidates of each group are taken within the group (see modality.py);
6. the selector picks the tokens (protected ones always in);
7. the decode policy sees the selection (e.g. to seed decode-time scores).

With ``route``, each branch is the parent node with the branch's fields merged over it (the
preset rules of ``kvlab.config.loader.merge``: lists and renamed components replaced whole); the rule
picks a branch per sample at every layer and the branches' selections are combined row by row.
``decode`` and ``schedule`` belong to the parent only.
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
from kvlab.compression.merge import MergeSelector  # noqa: F401  (registers the merge selector)
from kvlab.compression.mixers import MIXERS
from kvlab.compression.modality import group_topk_mask
from kvlab.compression.routing import ROUTE_RULES, RouteDecision, combine_selections, pick_rows
from kvlab.compression.selectors import SELECTORS, Selection
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import merge
from kvlab.config.registry import to_plain

WHERE = "model.compression"
FIELDS = ("budget", "importance", "diversity", "mixer", "allocate", "select", "decode", "schedule", "route")
ROUTE_FIELDS = ("rule", "branches")
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
    when the pipeline is asked to record scores). ``scorer_scores`` then also holds each
    scorer's own ``[B, Hkv, T]`` output by name (non-candidate positions -inf) for the per-scorer
    TensorBoard histograms. ``route`` says which branch each sample took when the pipeline routes.
    """

    layer_idx: int
    kept: torch.Tensor
    budget: torch.Tensor
    selection: Selection | None = None
    seconds: float = 0.0
    scores: torch.Tensor | None = None
    route: RouteDecision | None = None
    scorer_scores: dict[str, torch.Tensor] | None = None


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
    route_rule: Any = None
    branches: dict[str, Pipeline] = field(default_factory=dict)

    @classmethod
    def from_config(cls, node: Any) -> Pipeline:
        """Build and validate a pipeline from a ``model.compression`` node (None means full cache)."""
        node = to_plain(node) or {}
        if not isinstance(node, dict):
            raise ConfigError(f"{WHERE} must be a mapping (see docs/architecture.md), got {node!r}.")
        _check_fields(node, FIELDS, WHERE)
        if node.get("route") is not None:
            return cls._routed(node)
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
            decode_policy=DECODE_POLICIES.build(
                node.get("decode") or "none",
                f"{WHERE}.decode",
                # h2o's default recent window (a token count; a ratio window leaves the policy's default)
                **({"recent": budget.window} if budget and not budget.window_is_ratio else {}),
            ),
            schedule=schedule,
        )
        pipeline._check_window()
        pipeline.mixer.check_inputs(len(importance), len(diversity), f"{WHERE}.mixer")
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
        branches = [c for branch in self.branches.values() for c in branch.components()]
        return [*parts, self.modality_allocator, self.selector, self.decode_policy, *branches]

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
        """False for the full cache (no scorer configured, in no branch)."""
        return bool(self.importance or self.diversity) or any(b.compresses for b in self.branches.values())

    def compress(self, ctx: LayerContext, record_scores: bool = False) -> tuple[Selection, LayerReport]:
        """Choose what layer ``ctx.layer_idx`` keeps. See the module docstring for the steps."""
        selection, report = self._select(ctx, record_scores)
        self.decode_policy.on_compress(ctx, selection)
        return selection, report

    def _select(self, ctx: LayerContext, record_scores: bool) -> tuple[Selection, LayerReport]:
        if self.route_rule is not None:
            return self._select_routed(ctx, record_scores)
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
        if quota is not None:  # keep exactly the per-group top candidates
            chosen = group_topk_mask(candidate_scores, quota.groups, quota.quota)
            head_counts = chosen.sum(-1)
            candidate_scores = torch.where(chosen, float("inf"), float("-inf"))

        final = candidate_scores.masked_fill(protected[:, None, :], float("inf"))
        counts = head_counts + protected_counts[:, None]
        selection = self.selector.select(final, counts, ctx)
        report = LayerReport(
            ctx.layer_idx, selection.counts, layer_budget, selection, scores=mixed if record_scores else None
        )
        if record_scores:
            report.scorer_scores = self._scorer_scores(importance, diversity, candidates)
        return selection, report

    def _scorer_scores(
        self, importance: list[torch.Tensor], diversity: list[torch.Tensor], candidates: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each scorer's output by name (a name used twice gets its position: ``key_norm_2``)."""
        scorers = [*self.importance, *self.diversity]
        named: dict[str, torch.Tensor] = {}
        for i, (scorer, scores) in enumerate(zip(scorers, [*importance, *diversity], strict=True)):
            name = scorer.registry_name
            name = f"{name}_{i}" if name in named else name
            named[name] = scores.float().masked_fill(~candidates, float("-inf"))
        return named

    # --- routing -------------------------------------------------------------------------------
    @classmethod
    def _routed(cls, node: dict[str, Any]) -> Pipeline:
        """A pipeline whose layers go to branches (parent node + branch fields) chosen by a rule."""
        where = f"{WHERE}.route"
        route = node["route"]
        if not isinstance(route, dict) or not isinstance(route.get("branches"), dict) or "rule" not in route:
            raise ConfigError(
                f"{where} must be a mapping with 'rule' (e.g. {{name: latch, metric: {{name: ncar}}}}) and "
                "'branches' (branch name -> fields merged over the parent, e.g. {unified: {}})."
            )
        _check_fields(route, ROUTE_FIELDS, where)
        rule = ROUTE_RULES.build(route["rule"], f"{where}.rule")
        parent = {k: v for k, v in node.items() if k != "route"}
        branches = {}
        for name, branch in route["branches"].items():
            branch = branch or {}
            if not isinstance(branch, dict):
                raise ConfigError(
                    f"{where}.branches.{name} must be a mapping of pipeline fields, got {branch!r}."
                )
            for key in ("decode", "schedule"):
                if key in branch:
                    raise ConfigError(
                        f"{where}.branches.{name}.{key}: '{key}' applies to the whole pipeline; set it on "
                        f"{WHERE}.{key} instead of inside a branch."
                    )
            branches[name] = cls.from_config(merge(parent, branch))
        for name in rule.branch_names:
            if name not in branches:
                raise ConfigError(
                    f"{where}.rule refers to branch '{name}', which {where}.branches does not define "
                    f"(it defines: {', '.join(branches) or 'none'}).{did_you_mean(name, list(branches))}"
                )
        pipeline = cls.from_config(parent)
        pipeline.route_rule = rule
        pipeline.branches = branches
        return pipeline

    def _select_routed(self, ctx: LayerContext, record_scores: bool) -> tuple[Selection, LayerReport]:
        """Run the branch each sample is routed to; combine the selections row by row."""
        decision = self.route_rule.decide(ctx)
        names = sorted(set(decision.branches))
        runs = [self.branches[name]._select(ctx, record_scores) for name in names]
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
            )
        report.route = decision
        return selection, report
