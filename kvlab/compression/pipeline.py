"""Pipeline: the compression method of a run, assembled from registry components by YAML.

Schema of ``model.compression`` (every field optional; no scorer at all means the full cache)::

    budget: {tokens: 128, window: 32, sinks: 0}      # or {ratio: 0.2, ...}; see budget.py
    importance:                                      # scorers keyed by the role they play
      attention: {name: window_attention, kernel: 5, pool: avg}
      value_norm: {}                                 # no `name`: the key is the component's name
    diversity: {}                                    # e.g. {keydiff: {}}
    mixer: {name: weighted_sum}                      # combines the roles; mixkv names them
    allocate:
      layer: {name: uniform}                         # or pyramid
      head: {name: uniform}                          # adakv: {name: adakv, signal: attention}
      modality: {name: none}
    select: {name: topk}
    decode: {name: none}                             # decode-time policy
    sliding_layers: window                           # or compress (sliding-window layers, below)
    route:                                           # optional: per-layer branches (see routing.py)
      rule: {name: latch, metric: {name: ncar}, before: decoupled, after: unified}
      branches: {decoupled: {allocate: {modality: {name: decoupled}}}, unified: {}}

Roles, not positions: a scorer's key under ``importance``/``diversity`` is its role, one
namespace for both; the mixer and a head allocator's ``signal`` refer to scorers by role, and a
key set to ``null`` removes a scorer inherited from a preset. Lists are refused (their order
used to decide roles). Settings have one source: the recent window is ``budget.window``; a
component restating it (``window_attention.window``, ``ncar.window``, ``h2o.recent``) takes it
from there and refuses a different value (``budget_settings`` on the component class).

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
A per-head rule (``text_sparsity``, HybridKV's classifier) picks a branch per (sample, KV head):
every branch some head took runs over the layer and each head's row comes from its own branch
(the branches share the layer budget; a retrieving branch's store serves its own heads only).
``decode``, ``schedule`` and ``sliding_layers`` belong to the parent only.

``schedule`` (a kvlab extension) says when layers are compressed. ``layerwise`` (the default):
each layer right after its own prefill attention, with the steps above. ``global``: the prefill
first runs :meth:`Pipeline.observe` on every layer (its route decision, every scorer's score,
the mix, and the layer allocator's ``observe`` hook, so the allocator sees all layers), keeping
each layer's full K/V; once the last layer's attention has run, the engine calls
:meth:`Pipeline.compress` on every layer in order, which reuses those scores and decisions.
A component that compares layers declares ``needs_all_layers`` (PrefixKV's online
``prefix_threshold``, HybridKV's ``scope: global`` head allocator) and is refused under
``layerwise``. A layer-local method keeps exactly the same tokens under both schedules.

Sliding-window layers (Mistral, Gemma 2/3, GPT-OSS: the attention function passes the layer's
``sliding_window`` W, :attr:`LayerContext.sliding_window`) never keep a token their next query
cannot see: only the prompt's last ``W - 1`` tokens are candidates. ``sliding_layers: window``
(the default) keeps exactly those, as the model bounds the layer itself, whatever the method;
``compress`` runs the method within them, the window standing for the layer's prompt (a
``ratio`` budget is a share of the window, a ``tokens`` budget is capped by it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.allocators import (
    HEAD_ALLOCATORS,
    LAYER_ALLOCATORS,
    MODALITY_ALLOCATORS,
    HeadAllocator,
    LayerAllocator,
    ModalityAllocator,
)
from kvlab.compression.budget import Budget
from kvlab.compression.context import LayerContext
from kvlab.compression.decode import DECODE_POLICIES, DecodePolicy
from kvlab.compression.diversity import DIVERSITY, DiversityScorer
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.compression.mixers import MIXERS, Mixer
from kvlab.compression.modality import group_topk_mask
from kvlab.compression.routing import (
    ROUTE_RULES,
    ROUTED_HEADS,
    RouteDecision,
    RouteRule,
    combine_selections,
    pick_rows,
)
from kvlab.compression.selectors import SELECTORS, Selector
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import merge
from kvlab.config.registry import to_plain

WHERE = "model.compression"
FIELDS = (
    "budget", "importance", "diversity", "mixer", "allocate", "select", "decode", "schedule", "route",
    "sliding_layers",
)  # fmt: skip
SLIDING_LAYERS = ("window", "compress")
SCHEDULES = ("layerwise", "global")
_SCORED = "pipeline_scores"  # ctx.state keys of what schedule: global observed, per pipeline and layer
_DECIDED = "pipeline_route_decision"
#: ctx.state key (schedule: global): the set of layers kept whole without scoring (sliding-window
#: layers under ``sliding_layers: window``), so a component comparing layers knows none is missing
WHOLE_LAYERS = "pipeline_whole_layers"
ROUTE_FIELDS = ("rule", "branches")
ALLOCATE_FIELDS = ("layer", "head", "modality")
ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def within_window(ctx: LayerContext) -> LayerContext:
    """``ctx`` with only the prompt tokens the layer's next query sees left valid: the last
    ``sliding_window - 1`` of the padded row (left padding: each sample's own last tokens)."""
    T = ctx.valid.shape[1]
    visible = torch.arange(T, device=ctx.valid.device) >= T - (ctx.sliding_window - 1)
    return dataclasses.replace(ctx, valid=ctx.valid & visible, _memo={})


def _check_fields(node: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in node:
        if key not in allowed:
            raise ConfigError(
                f"{where} has no field '{key}'.{did_you_mean(key, allowed)} "
                f"Its fields are: {', '.join(allowed)}."
            )


def _keyed_by_role(node: Any, where: str) -> dict[str, dict[str, Any]]:
    """``{role: component node}`` from a scorer section (a mapping keyed by role; ``null`` entries dropped).

    A component node without ``name`` takes its role as the name (``value_norm: {}``). A list
    (the old positional form) or a bare component is refused with the mapping to write instead.
    """
    if node is None:
        return {}
    if isinstance(node, list) or (isinstance(node, dict) and isinstance(node.get("name"), str)):
        items = node if isinstance(node, list) else [node]
        suggestion = ", ".join(
            f"{item['name']}: {_inline({k: v for k, v in item.items() if k != 'name'})}"
            if isinstance(item, dict) and isinstance(item.get("name"), str)
            else f"{item}: {{}}"
            for item in items
        )
        raise ConfigError(
            f"{where} must map each scorer's role to the scorer, so that mixers and allocators name "
            f"the scorer they use instead of relying on list order. Write `{where.rsplit('.', 1)[-1]}: "
            f"{{{suggestion}}}` (a key may be any name, e.g. `attention: {{name: window_attention}}`) "
            "and name the roles where they are used: `mixer: {name: mixkv, extrinsic: <role>, "
            "intrinsic: [<role>], diversity: [<role>]}`, `allocate.head.signal: <role>`."
        )
    if not isinstance(node, dict):
        raise ConfigError(
            f"{where} must be a mapping from role to scorer, e.g. "
            f"`{{attention: {{name: window_attention}}}}`, got {node!r}."
        )
    roles: dict[str, dict[str, Any]] = {}
    for role, component in node.items():
        if component is None:
            continue
        if not isinstance(role, str) or not ROLE.match(role):
            raise ConfigError(
                f"{where}: role {role!r} must be a name (letters, digits, underscores), e.g. attention."
            )
        if isinstance(component, str):
            component = {"name": component}
        if not isinstance(component, dict):
            raise ConfigError(
                f"{where}.{role} must be a scorer mapping such as {{name: window_attention}} (or {{}} to "
                f"use the scorer named '{role}'), got {component!r}."
            )
        roles[role] = component if "name" in component else {"name": role, **component}
    return roles


def _inline(node: dict[str, Any]) -> str:
    """``{a: 1, b: x}``: a flow-style YAML mapping for messages."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in node.items()) + "}"


def _take_budget_settings(component: Any, where: str, budget: Budget | None) -> None:
    """Fill the parameters ``component`` restates from the budget; refuse a value that differs.

    ``component.budget_settings`` maps a parameter to a budget field (e.g. ``window``). Unset
    (None) parameters take the budget's value when it is a token count; a set one must equal it.
    """
    for param, setting in getattr(component, "budget_settings", {}).items():
        own = getattr(component, param)
        if budget is None:
            continue
        value = getattr(budget, setting)
        is_count = isinstance(value, int) and not isinstance(value, bool)
        if own is None:
            if is_count:
                setattr(component, param, value)
            continue
        if not is_count or own != value:
            raise ConfigError(
                f"{where}.{param} = {own} differs from {WHERE}.budget.{setting} = {value}: the "
                f"{setting} is set once, in the budget, and {where.rsplit('.', 1)[-1]} reads it from "
                f"there. Remove `{param}` from {where} (or make it equal), and set "
                f"{WHERE}.budget.{setting} to the {setting} you want."
            )


def _check_shared_budget(branch: dict[str, Any], where: str) -> None:
    """A per-head route's branch may not change the layer budget its heads share."""
    allocate = branch.get("allocate")
    layer = allocate.get("layer") if isinstance(allocate, dict) else None
    for key, value in (("budget", branch.get("budget")), ("allocate.layer", layer)):
        if value is not None:
            raise ConfigError(
                f"{where}.{key}: the rule routes each KV head, and the heads of a layer share one layer "
                f"budget; set {WHERE}.{key} on the parent pipeline instead of inside a branch."
            )


@dataclass
class LayerReport:
    """What one layer's compression did, for predictions and TensorBoard.

    ``kept`` is ``[B, Hkv]`` (tokens kept per head), ``budget`` the layer budget ``[B]``,
    ``selection`` which positions were kept, and ``scores`` the mixed ``[B, Hkv, T]`` score (only
    when the pipeline is asked to record scores). ``scorer_scores`` then also holds each
    scorer's own ``[B, Hkv, T]`` output by role (non-candidate positions -inf) for the per-scorer
    TensorBoard histograms. ``route`` says which branch each sample took when the pipeline routes.
    ``overshoot`` ``[B]`` counts the tokens per head a sample keeps beyond its asked budget
    because its protected window does not fit (``Budget.overshoot``; None without a budget).
    """

    layer_idx: int
    kept: torch.Tensor
    budget: torch.Tensor
    selection: Selection | None = None
    seconds: float = 0.0
    scores: torch.Tensor | None = None
    route: RouteDecision | None = None
    scorer_scores: dict[str, torch.Tensor] | None = None
    overshoot: torch.Tensor | None = None


@dataclass
class Pipeline:
    """A compression method built from YAML. ``Pipeline.from_config(node)`` validates everything.

    ``importance`` and ``diversity`` map each scorer's role to the scorer (YAML order kept);
    the other fields are the one component of each slot. ``branches`` are the sub-pipelines a
    ``route_rule`` picks from, per sample and layer.
    """

    budget: Budget | None
    importance: dict[str, ImportanceScorer] = field(default_factory=dict)
    diversity: dict[str, DiversityScorer] = field(default_factory=dict)
    mixer: Mixer | None = None
    layer_allocator: LayerAllocator | None = None
    head_allocator: HeadAllocator | None = None
    modality_allocator: ModalityAllocator | None = None
    selector: Selector | None = None
    decode_policy: DecodePolicy | None = None
    schedule: str = "layerwise"
    sliding_layers: str = "window"
    route_rule: RouteRule | None = None
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
        schedule = node.get("schedule") or "layerwise"
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"{WHERE}.schedule must be 'layerwise' (compress each layer right after its prefill "
                "attention) or 'global' (score every layer during the prefill, then allocate over all "
                f"layers and compress them), got {schedule!r}.{did_you_mean(str(schedule), SCHEDULES)}"
            )
        sliding_layers = node.get("sliding_layers") or "window"
        if sliding_layers not in SLIDING_LAYERS:
            raise ConfigError(
                f"{WHERE}.sliding_layers must be 'window' (a sliding-window layer keeps the window the "
                "model attends to) or 'compress' (the method compresses within that window), got "
                f"{sliding_layers!r}."
            )
        importance_nodes = _keyed_by_role(node.get("importance"), f"{WHERE}.importance")
        diversity_nodes = _keyed_by_role(node.get("diversity"), f"{WHERE}.diversity")
        for role in importance_nodes.keys() & diversity_nodes.keys():
            raise ConfigError(
                f"{WHERE}: role '{role}' names both an importance and a diversity scorer; roles are one "
                "namespace (mixers refer to them by name), so rename one of the two keys."
            )
        if (importance_nodes or diversity_nodes) and node.get("budget") is None:
            raise ConfigError(
                f"{WHERE}.budget is missing: a pipeline with scorers needs a budget, e.g. "
                "`budget: {tokens: 128, window: 32}` or `budget: {ratio: 0.2, window: 32}`."
            )
        budget = Budget.from_config(node["budget"]) if node.get("budget") is not None else None
        importance = {
            role: cls._component(IMPORTANCE, n, f"{WHERE}.importance.{role}", budget)
            for role, n in importance_nodes.items()
        }
        diversity = {
            role: cls._component(DIVERSITY, n, f"{WHERE}.diversity.{role}", budget)
            for role, n in diversity_nodes.items()
        }
        pipeline = cls(
            budget=budget,
            importance=importance,
            diversity=diversity,
            mixer=cls._component(MIXERS, node.get("mixer") or "weighted_sum", f"{WHERE}.mixer", budget),
            layer_allocator=cls._component(
                LAYER_ALLOCATORS, allocate.get("layer") or "uniform", f"{WHERE}.allocate.layer", budget
            ),
            head_allocator=cls._component(
                HEAD_ALLOCATORS, allocate.get("head") or "uniform", f"{WHERE}.allocate.head", budget
            ),
            modality_allocator=cls._component(
                MODALITY_ALLOCATORS, allocate.get("modality") or "none", f"{WHERE}.allocate.modality", budget
            ),
            selector=cls._component(SELECTORS, node.get("select") or "topk", f"{WHERE}.select", budget),
            decode_policy=cls._decode_policy(node.get("decode") or "none", budget),
            schedule=schedule,
            sliding_layers=sliding_layers,
        )
        pipeline._check_roles()
        pipeline._check_schedule()
        return pipeline

    @staticmethod
    def _component(registry: Any, node: Any, where: str, budget: Budget | None) -> Any:
        """Build one component and give it the budget settings it restates (see module docstring)."""
        component = registry.build(node, where)
        _take_budget_settings(component, where, budget)
        return component

    @staticmethod
    def _decode_policy(node: Any, budget: Budget | None) -> DecodePolicy:
        """The decode policy; a policy with a ``recent`` window takes ``budget.window``.

        An explicit ``recent`` must equal a token-count ``budget.window``; with a ratio window
        (a different count per prompt) or no budget, the policy's ``recent`` must be written.
        """
        where = f"{WHERE}.decode"
        policy = DECODE_POLICIES.build(node, where)
        if not hasattr(policy, "recent"):
            return policy
        written = isinstance(node, dict) and "recent" in node
        window = budget.window if budget is not None else None
        if isinstance(window, int) and not isinstance(window, bool):
            if written and policy.recent != window:
                raise ConfigError(
                    f"{where}.recent = {policy.recent} differs from {WHERE}.budget.window = {window}: the "
                    f"recent window is set once, in the budget, and the decode policy keeps it too. Remove "
                    f"`recent` from {where} and set {WHERE}.budget.window to the window you want."
                )
            policy.recent = window
        elif not written:
            raise ConfigError(
                f"{where} '{policy.registry_name}' keeps a recent window of a fixed size, and "
                f"{WHERE}.budget.window is {'a fraction of each prompt' if budget else 'not set'}: write "
                f"the decode window in tokens, e.g. `decode: {{name: {policy.registry_name}, recent: 32}}`."
            )
        return policy

    @property
    def roles(self) -> list[str]:
        """Every scorer's role: importance roles then diversity roles, in YAML order."""
        return [*self.importance, *self.diversity]

    def _check_roles(self) -> None:
        """The mixer's and the head allocator's roles exist; every scorer has a part in the mix."""
        self.mixer.check_roles(list(self.importance), list(self.diversity), f"{WHERE}.mixer")
        signal = self.head_allocator.signal
        if signal != "mixed" and signal not in self.roles:
            raise ConfigError(
                f"{WHERE}.allocate.head.signal = '{signal}' is not a scorer's role "
                f"({', '.join(self.roles) or 'no scorers'}).{did_you_mean(signal, self.roles)} Write "
                "`signal: mixed` (the mixed score) or the key of the scorer to allocate from."
            )

    def _slots(self) -> list[tuple[str, Any]]:
        """``(YAML field, component)`` of this node's own components (branches not included)."""
        scorers = [(f"importance.{role}", c) for role, c in self.importance.items()]
        scorers += [(f"diversity.{role}", c) for role, c in self.diversity.items()]
        slots = [("mixer", self.mixer), ("allocate.layer", self.layer_allocator),
                 ("allocate.head", self.head_allocator), ("allocate.modality", self.modality_allocator),
                 ("select", self.selector), ("decode", self.decode_policy)]  # fmt: skip
        return [(f"{WHERE}.{name}", c) for name, c in [*scorers, *slots] if c is not None]

    def all_layer_components(self) -> list[tuple[str, Any]]:
        """``(field, component)`` of every component that compares layers (``needs_all_layers``),
        branches included: they need ``schedule: global``."""
        own = [(where, c) for where, c in self._slots() if getattr(c, "needs_all_layers", False)]
        return own + [pair for branch in self.branches.values() for pair in branch.all_layer_components()]

    @property
    def needs_all_layers(self) -> bool:
        """True when a component compares layers, so no layer can be compressed before the last
        layer's prefill (``schedule: global``)."""
        return bool(self.all_layer_components())

    def _check_schedule(self) -> None:
        """A component comparing layers needs ``schedule: global``."""
        needs = self.all_layer_components()
        if needs and self.schedule != "global":
            where, component = needs[0]
            raise ConfigError(
                f"{where} ({getattr(component, 'registry_name', '') or type(component).__name__}) compares "
                f"every layer, whose scores exist only after the last layer's prefill, so it cannot run "
                f"with {WHERE}.schedule = {self.schedule}: set `{WHERE}.schedule: global` (memory during "
                "the prefill is then the full cache), or use a component that needs only its own layer "
                "(for PrefixKV: the offline `prefix_calibrated` allocator with a calibration artefact)."
            )

    def components(self) -> list[Any]:
        """Every configured component (scorers, mixer, allocators, selector, decode policy, branches)."""
        parts = [*self.importance.values(), *self.diversity.values(), self.mixer, self.layer_allocator]
        branches = [c for branch in self.branches.values() for c in branch.components()]
        slots = [self.head_allocator, self.modality_allocator, self.selector, self.decode_policy]
        return [*parts, *slots, *branches]

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

    def observe(self, ctx: LayerContext) -> None:
        """``schedule: global``, during the prefill of layer ``ctx.layer_idx``: everything that reads
        its queries, kept in ``ctx.state`` for :meth:`compress` after the last layer.

        The route decision (per branch taken: that branch's observation), the budget's protected
        tokens, every scorer's score ``[B, Hkv, T]`` and the mix, then the layer allocator's
        ``observe(ctx, scores, mixed)`` hook when it has one (how ``prefix_threshold`` sees every
        layer). A sliding-window layer kept whole (``sliding_layers: window``) observes nothing and
        is listed in ``ctx.state[WHOLE_LAYERS]``.
        """
        if ctx.sliding_window is not None:
            ctx = within_window(ctx)
            if self.sliding_layers == "window":
                ctx.state.setdefault(WHOLE_LAYERS, set()).add(ctx.layer_idx)
                return
        self._observe(ctx)

    def _observe(self, ctx: LayerContext) -> None:
        if self.route_rule is not None:
            if self.budget is not None:
                self._protect(ctx)
            decision = self.route_rule.decide(ctx)
            ctx.state[(_DECIDED, id(self), ctx.layer_idx)] = decision
            if decision.heads is None:
                for name in sorted(set(decision.branches)):
                    self.branches[name]._observe(ctx)
                return
            heads = decision.heads.to(ctx.keys.device)
            for i in sorted(set(heads.flatten().tolist())):
                ctx.state[ROUTED_HEADS] = heads == i
                try:
                    self.branches[decision.head_names[i]]._observe(ctx)
                finally:
                    ctx.state.pop(ROUTED_HEADS, None)
            return
        if not self.compresses:
            return
        self._protect(ctx)
        scores, mixed = self._score(ctx)
        ctx.state[(_SCORED, id(self), ctx.layer_idx)] = (scores, mixed)
        hook = getattr(self.layer_allocator, "observe", None)
        if hook is not None:
            hook(ctx, scores, mixed)

    def _score(self, ctx: LayerContext) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every scorer's ``[B, Hkv, T]`` score by role and their fp32 mix ``[B, Hkv, T]``: the ones
        :meth:`observe` kept for this layer (``schedule: global``, handed over once), else computed."""
        held = ctx.state.pop((_SCORED, id(self), ctx.layer_idx), None)
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
                self.decode_policy.on_compress(ctx, selection)
                return selection, report
        selection, report = self._select(ctx, record_scores)
        self.decode_policy.on_compress(ctx, selection)
        return selection, report

    def _keep_all(self, ctx: LayerContext) -> tuple[Selection, LayerReport]:
        """Keep every valid token of the layer (the full cache)."""
        keep_all = ctx.valid[:, None, :].expand(-1, ctx.num_kv_heads, -1)
        counts = ctx.lengths[:, None].expand(-1, ctx.num_kv_heads).clone()
        scores = torch.where(keep_all, 0.0, float("-inf"))
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
            overshoot=self.budget.overshoot(lengths),
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
            for key in ("decode", "schedule", "sliding_layers"):
                if key in branch:
                    raise ConfigError(
                        f"{where}.branches.{name}.{key}: '{key}' applies to the whole pipeline; set it on "
                        f"{WHERE}.{key} instead of inside a branch."
                    )
            if rule.per_head:
                _check_shared_budget(branch, f"{where}.branches.{name}")
            branches[name] = cls.from_config(merge(parent, branch))
            allocator = branches[name].layer_allocator
            if getattr(allocator, "needs_all_layers", False):
                raise ConfigError(
                    f"{where}: the layer allocator '{allocator.registry_name}' compares every layer's "
                    "scores, but in a routed pipeline each branch scores only the layers (or heads) routed "
                    f"to it. Use it without `route`, or give {WHERE}.allocate.layer an allocator that needs "
                    "only its own layer (e.g. prefix_calibrated, uniform)."
                )
        for name in rule.branch_names:
            if name not in branches:
                raise ConfigError(
                    f"{where}.rule refers to branch '{name}', which {where}.branches does not define "
                    f"(it defines: {', '.join(branches) or 'none'}).{did_you_mean(name, list(branches))}"
                )
        pipeline = cls.from_config(parent)
        for name, part in rule.parts().items():  # e.g. the metric observing the budget's window
            _take_budget_settings(part, f"{where}.rule.{name}", pipeline.budget)
        pipeline.route_rule = rule
        pipeline.branches = branches
        return pipeline

    def _select_routed(self, ctx: LayerContext, record_scores: bool) -> tuple[Selection, LayerReport]:
        """Run the branch each sample (each KV head, for a per-head rule) is routed to; combine the
        selections row by row."""
        if self.budget is not None:  # the rule's metric observes the parent budget's window
            self._protect(ctx)
        decision = ctx.state.pop((_DECIDED, id(self), ctx.layer_idx), None)  # schedule: global
        if decision is None:
            decision = self.route_rule.decide(ctx)
        if decision.heads is not None:
            return self._select_per_head(ctx, decision, record_scores)
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
                overshoot=pick_rows([r.overshoot for r in reports], choice),
            )
        report.route = decision
        return selection, report

    def _select_per_head(
        self, ctx: LayerContext, decision: RouteDecision, record_scores: bool
    ) -> tuple[Selection, LayerReport]:
        """Run every branch some KV head is routed to (each over the whole layer) and take each
        (sample, head) row from its own branch. The branches share the layer budget (checked when
        built), so the per-sample fields of the report come from any of them."""
        heads = decision.heads.to(ctx.keys.device)
        used = sorted(set(heads.flatten().tolist()))
        runs = []
        for i in used:
            ctx.state[ROUTED_HEADS] = heads == i
            try:
                runs.append(self.branches[decision.head_names[i]]._select(ctx, record_scores))
            finally:
                ctx.state.pop(ROUTED_HEADS, None)
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
            )
        report.route = decision
        return selection, report
