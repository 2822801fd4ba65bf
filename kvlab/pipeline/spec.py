"""Pipeline: the compression method of a run, assembled from registry components by YAML.

The package: this module holds the specification (the dataclass, its building and walks), its
YAML checks are in :mod:`kvlab.pipeline.validation`, one layer's execution in
:mod:`kvlab.pipeline.execution`, routed execution in :mod:`kvlab.pipeline.routed`.

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
    quantize: {name: kivi, bits: 2, group: 32, residual: 128}   # optional: kept entries as codes
    channels: {name: think, keep: 0.5}               # optional: kept keys with fewer channels
    prefill: {name: once}                            # or {name: progressive, chunk: 512, question: true}
    route:                                           # optional: per-layer branches (see routing.py)
      rule: {name: latch, metric: {name: ncar}, before: decoupled, after: unified}
      branches: {decoupled: {allocate: {modality: {name: decoupled}}}, unified: {}}

Roles, not positions: a scorer's key under ``importance``/``diversity`` is its role, one
namespace for both; the mixer and a head allocator's ``signal`` refer to scorers by role, and a
key set to ``null`` removes a scorer inherited from a preset. Lists are refused (their order
used to decide roles). Settings have one source: the recent window is ``budget.window``; a
component restating it (``window_attention.window``, ``ncar.window``, ``h2o.recent``) takes it
from there and refuses a different value (``budget_settings`` on the component class); a scorer
restating a layer allocator's parameter takes it from the allocator (``layer_allocator_settings``).

One layer's compression (:meth:`~kvlab.pipeline.execution.LayerExecution.compress`):

1. per-sample budget (protected included) -> layer allocator -> this layer's budget ``[B]``;
2. samples whose budget covers their prompt keep everything;
3. importance and diversity scores ``[B, Hkv, T]`` -> mixer -> one score;
4. protected tokens (window, sinks) are taken out; the head allocator splits the remaining
   budget across KV heads ``[B, Hkv]`` (ragged allowed);
5. the modality allocator may split each head's budget by modality (text / vision groups):
   the top candidates of each group are taken within the group (see modality.py);
6. the selector picks the tokens (protected ones always in);
7. the decode policy sees the selection (e.g. to seed decode-time scores);
8. the quantizer, when ``quantize`` is set, rides on the selection: the cache stores the kept
   entries (merged ones included) as codes (:mod:`kvlab.compression.quantizers`);
9. the channel pruner, when ``channels`` is set, picks each (sample, KV head)'s key channels from
   the kept keys (and the window's queries); the cache stores the kept keys with those channels
   only (:mod:`kvlab.compression.channels`).

With ``route``, each branch is the parent node with the branch's fields merged over it (the
preset rules of ``kvlab.config.loader.merge``: lists and renamed components replaced whole); the rule
picks a branch per sample at every layer and the branches' selections are combined row by row.
A per-head rule (``text_sparsity``, HybridKV's classifier) picks a branch per (sample, KV head):
every branch some head took runs over the layer and each head's row comes from its own branch
(the branches share the layer budget; a retrieving branch's store serves its own heads only).
``decode``, ``schedule``, ``sliding_layers``, ``quantize``, ``channels`` and ``prefill`` belong to
the parent only (a channel pruner runs on the combined selection).

``schedule`` (a kvlab extension) says when layers are compressed. ``layerwise`` (the default):
each layer right after its own prefill attention, with the steps above. ``global``: the prefill
first runs :meth:`~kvlab.pipeline.execution.LayerExecution.observe` on every layer (its route
decision, every scorer's score, the mix, and the layer allocator's ``observe`` hook, so the
allocator sees all layers), keeping each layer's full K/V; once the last layer's attention has
run, the engine calls :meth:`~kvlab.pipeline.execution.LayerExecution.compress` on every layer
in order, which reuses those scores and decisions.
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.compression.allocators import (
    HEAD_ALLOCATORS,
    LAYER_ALLOCATORS,
    MODALITY_ALLOCATORS,
    HeadAllocator,
    LayerAllocator,
    ModalityAllocator,
)
from kvlab.compression.budget import Budget
from kvlab.compression.channels import ChannelPruner
from kvlab.compression.decode import DecodePolicy
from kvlab.compression.diversity import DIVERSITY, DiversityScorer
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.compression.mixers import MIXERS, Mixer
from kvlab.compression.prefill_modes import PREFILL_MODES, PrefillMode
from kvlab.compression.quantizers import Quantizer
from kvlab.compression.routing import ROUTE_RULES, RouteRule
from kvlab.compression.selectors import SELECTORS, Selector
from kvlab.config.capabilities import Component, Outcome, Report
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import merge
from kvlab.config.registry import to_plain
from kvlab.models.facts import check_config_facts
from kvlab.models.shape import model_config, model_shape
from kvlab.pipeline.capabilities import Part, PipelineCapabilities
from kvlab.pipeline.execution import LayerExecution
from kvlab.pipeline.report import LayerReport
from kvlab.pipeline.routed import RoutedExecution
from kvlab.pipeline.validation import (
    ALLOCATE_FIELDS,
    FIELDS,
    WHERE,
    build_channel_pruner,
    build_component,
    build_decode_policy,
    build_quantizer,
    check_branch_node,
    check_channel_pruner,
    check_fields,
    check_quantizer,
    check_route_node,
    check_schedule,
    check_sliding_layers,
    keyed_by_role,
)


@dataclass
class Pipeline(LayerExecution, RoutedExecution):
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
    quantizer: Quantizer | None = None
    channel_pruner: ChannelPruner | None = None
    prefill_mode: PrefillMode = field(default_factory=lambda: PREFILL_MODES.build("once"))
    #: the model :meth:`bind_model` last bound (None: none yet)
    bound_model: str | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, node: Any) -> Pipeline:
        """Build and validate a pipeline from a ``model.compression`` node (None means full cache)."""
        pipeline = cls._from_node(node)
        pipeline._check_route_rules()
        return pipeline

    @classmethod
    def _from_node(cls, node: Any) -> Pipeline:
        """A pipeline of ``node`` (the whole method, a routed pipeline's parent or one of its
        branches), built and validated as far as the node alone allows."""
        node = to_plain(node) or {}
        if not isinstance(node, dict):
            raise ConfigError(f"{WHERE} must be a mapping (see docs/architecture.md), got {node!r}.")
        check_fields(node, FIELDS, WHERE)
        if node.get("route") is not None:
            return cls._routed(node)
        allocate = node.get("allocate") or {}
        if not isinstance(allocate, dict):
            raise ConfigError(f"{WHERE}.allocate must be a mapping with keys {', '.join(ALLOCATE_FIELDS)}.")
        check_fields(allocate, ALLOCATE_FIELDS, f"{WHERE}.allocate")
        schedule = check_schedule(node.get("schedule"))
        sliding_layers = check_sliding_layers(node.get("sliding_layers"))
        importance_nodes = keyed_by_role(node.get("importance"), f"{WHERE}.importance")
        diversity_nodes = keyed_by_role(node.get("diversity"), f"{WHERE}.diversity")
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
        layer_where = f"{WHERE}.allocate.layer"
        layer_allocator = build_component(
            LAYER_ALLOCATORS, allocate.get("layer") or "uniform", layer_where, budget
        )
        scorer = lambda registry, n, where: build_component(
            registry, n, where, budget, (layer_allocator, layer_where)
        )
        importance = {
            role: scorer(IMPORTANCE, n, f"{WHERE}.importance.{role}") for role, n in importance_nodes.items()
        }
        diversity = {
            role: scorer(DIVERSITY, n, f"{WHERE}.diversity.{role}") for role, n in diversity_nodes.items()
        }
        pipeline = cls(
            budget=budget,
            importance=importance,
            diversity=diversity,
            mixer=build_component(MIXERS, node.get("mixer") or "weighted_sum", f"{WHERE}.mixer", budget),
            layer_allocator=layer_allocator,
            head_allocator=build_component(
                HEAD_ALLOCATORS, allocate.get("head") or "uniform", f"{WHERE}.allocate.head", budget
            ),
            modality_allocator=build_component(
                MODALITY_ALLOCATORS, allocate.get("modality") or "none", f"{WHERE}.allocate.modality", budget
            ),
            selector=build_component(SELECTORS, node.get("select") or "topk", f"{WHERE}.select", budget),
            decode_policy=build_decode_policy(node.get("decode") or "none", budget),
            schedule=schedule,
            sliding_layers=sliding_layers,
            quantizer=build_quantizer(node.get("quantize")),
            channel_pruner=build_channel_pruner(node.get("channels"), budget),
            prefill_mode=PREFILL_MODES.build(node.get("prefill") or "once", f"{WHERE}.prefill"),
        )
        pipeline._check_roles()
        pipeline._check_schedule()
        pipeline._check_prefill()
        if pipeline.quantizer is not None:
            check_quantizer(pipeline.quantizer, pipeline.walk())
        if pipeline.channel_pruner is not None:
            check_channel_pruner(
                pipeline.channel_pruner, pipeline.walk(), pipeline.quantizer is not None,
                pipeline.prefill_mode.progressive,
            )  # fmt: skip
        return pipeline

    @property
    def roles(self) -> list[str]:
        """Every scorer's role: importance roles then diversity roles, in YAML order."""
        return [*self.importance, *self.diversity]

    def _check_roles(self) -> None:
        """The roles the mixer, the head allocator and the selector name exist; every scorer has a
        part in the mix."""
        self.mixer.check_roles(list(self.importance), list(self.diversity), f"{WHERE}.mixer")
        for slot, allocator in (("layer", self.layer_allocator), ("head", self.head_allocator)):
            signal = getattr(allocator, "signal", "mixed")  # the allocators that compare a score say which
            if signal != "mixed" and signal not in self.roles:
                raise ConfigError(
                    f"{WHERE}.allocate.{slot}.signal = '{signal}' is not a scorer's role "
                    f"({', '.join(self.roles) or 'no scorers'}).{did_you_mean(signal, self.roles)} Write "
                    "`signal: mixed` (the mixed score) or the key of the scorer to allocate from."
                )
        for role in self.selector.scorer_roles():
            if role not in self.roles:
                roles = ", ".join(self.roles) or "no scorers"
                raise ConfigError(
                    f"{WHERE}.select ({self.selector.registry_name}) ranks by the role '{role}', which is "
                    f"not a scorer's role ({roles}).{did_you_mean(role, self.roles)} Name the key of a "
                    "scorer under model.compression.importance or .diversity."
                )

    def _check_route_rules(self) -> None:
        """Every component that reads a route rule's decisions (``needs_route_rule``: HybridKV's head
        allocator reads the heads' classes) is in a pipeline routed by one of those rules."""
        rule = self.route_rule.registry_name if self.route_rule is not None else None
        for part in self.walk():
            needs = part.component.needs_route_rule
            if needs and rule not in needs:
                names = " or ".join(f"'{n}'" for n in sorted(needs))
                routed = f"is routed by '{rule}'" if rule is not None else "has no route"
                raise ConfigError(
                    f"{part.field} '{part.component.registry_name}' reads the decisions of the route rule "
                    f"{names}, but this pipeline {routed}: add `{WHERE}.route: {{rule: {{name: "
                    f"{sorted(needs)[0]}}}, branches: ...}}` (the method's preset shows one), or choose "
                    "another component."
                )

    def walk(self, where: str = WHERE) -> list[Part]:
        """Every component with its YAML field: the scorers by role, the slots and their parts (the
        ``retrieve`` selector's index), the route rule and its parts, then every branch's (the one
        walk the pipeline's checks and capabilities read)."""
        parts = [Part(f"{where}.importance.{role}", c, "scorer") for role, c in self.importance.items()]
        parts += [Part(f"{where}.diversity.{role}", c, "scorer") for role, c in self.diversity.items()]
        slots = {"mixer": self.mixer, "allocate.layer": self.layer_allocator,
                 "allocate.head": self.head_allocator, "allocate.modality": self.modality_allocator,
                 "select": self.selector, "decode": self.decode_policy,
                 "quantize": self.quantizer, "channels": self.channel_pruner,
                 "prefill": self.prefill_mode}  # fmt: skip
        for name, component in slots.items():
            if component is not None:
                parts.append(Part(f"{where}.{name}", component, "slot"))
                parts += [Part(f"{where}.{name}.{n}", c, "slot") for n, c in component.parts().items()]
        if self.route_rule is not None:
            parts.append(Part(f"{where}.route.rule", self.route_rule, "route"))
            parts += [Part(f"{where}.route.rule.{n}", c, "route") for n, c in self.route_rule.parts().items()]
        for name, branch in self.branches.items():
            parts += branch.walk(f"{where}.route.branches.{name}")
        return parts

    def report(self, layers: Sequence[LayerReport], kv_bytes_kept: torch.Tensor) -> Report:
        """A batch's record fields and TensorBoard scalars from its components: each component
        class's :meth:`~kvlab.config.capabilities.Component.report` of the batch's
        :class:`~kvlab.config.capabilities.Outcome` once, merged in the order of :meth:`walk`.

        Args:
            layers: every layer's report, in the order they ran.
            kv_bytes_kept: ``[B]`` bytes of each sample's kept prompt K/V.

        Returns:
            A :class:`~kvlab.config.capabilities.Report`: one ``{field: value}`` per sample, the scalars.

        Raises:
            TypeError: a component reported a field its ``record_fields`` do not declare.
        """
        outcome = Outcome(layers, kv_bytes_kept)
        samples: list[dict[str, Any]] = [{} for _ in range(kv_bytes_kept.shape[0])]
        scalars: dict[str, float] = {}
        first: dict[type, Component] = {}
        for part in self.walk():
            first.setdefault(type(part.component), part.component)
        for kind, component in first.items():
            report = component.report(outcome)
            if report is None:
                continue
            for sample, fields in zip(samples, report.samples, strict=True):
                undeclared = sorted(set(fields) - set(kind.record_fields))
                if undeclared:
                    raise TypeError(f"{kind.__name__}.report wrote {undeclared}, not in its record_fields")
                sample.update(fields)
            scalars.update(report.scalars)
        return Report(samples, scalars)

    @property
    def capabilities(self) -> PipelineCapabilities:
        """What this pipeline needs of the engine, from its components' declared capabilities."""
        return PipelineCapabilities.of(self.walk())

    @property
    def needs_all_layers(self) -> bool:
        """True when a component compares layers, so no layer can be compressed before the last
        layer's prefill (``schedule: global``)."""
        return bool(self.capabilities.comparing_layers)

    def _check_schedule(self) -> None:
        """A component comparing layers needs ``schedule: global``."""
        needs = self.capabilities.comparing_layers
        if needs and self.schedule != "global":
            part = needs[0]
            raise ConfigError(
                f"{part.field} ({part.name}) compares every layer, whose scores exist only after the last "
                f"layer's prefill, so it cannot run with {WHERE}.schedule = {self.schedule}: set "
                f"`{WHERE}.schedule: global` (memory during the prefill is then the full cache), or use a "
                "component that needs only its own layer (for PrefixKV: the offline `prefix_calibrated` "
                "allocator with a calibration artefact)."
            )

    def _check_prefill(self) -> None:
        """A progressive prefill (``prefill: {name: progressive}``) compresses every layer after each
        chunk, holding between chunks each sample's kept entries as one dense row per layer; refuse
        what that cannot run, naming the field. A component reading the question needs
        ``question: true``, and ``question: true`` needs a component reading it; likewise a
        component reading the reconstruction and the ``reconstruct`` mode (KVzip)."""
        mode, where = self.prefill_mode, f"{WHERE}.prefill"
        readers = [p for p in self.walk() if p.component.capabilities.reads_question]
        if readers and not mode.question:
            raise ConfigError(
                f"{readers[0].field} ({readers[0].name}) scores with the question's attention, which only "
                f"a progressive prefill with the question appended provides: set `{where}: {{name: "
                "progressive, chunk: 512, question: true}` (Finch's preset: --config finch)."
            )
        rebuilders = [p for p in self.walk() if p.component.capabilities.reads_reconstruction]
        if rebuilders and not mode.reconstructs:
            raise ConfigError(
                f"{rebuilders[0].field} ({rebuilders[0].name}) scores from the model's reconstruction of the "
                f"prompt, which only the reconstruct prefill runs: set `{where}: {{name: reconstruct, chunk: "
                "2048}` (KVzip's preset: --config kvzip)."
            )
        if mode.reconstructs and not rebuilders:
            raise ConfigError(
                f"{where} = reconstruct runs the model again to score the prompt, but no scorer reads the "
                "reconstruction: add `importance: {attention: {name: reconstruction_attention}}` (KVzip), or "
                f"use `{where}: {{name: once}}`."
            )
        if not mode.progressive:
            return
        if mode.question and not readers:
            raise ConfigError(
                f"{where}.question = true appends the question to every chunk for scoring, but no scorer "
                "reads it: add `importance: {attention: {name: question_attention}}` (Finch), or set "
                f"{where}.question to false (the scorers then observe each chunk's own queries)."
            )
        refusals = [
            (self.budget is None or not self.compresses, f"{WHERE} has no scorer (the full cache); a "
             "progressive prefill needs a method to compress with"),
            (self.schedule == "global", f"{WHERE}.schedule = global compares layers after the whole "
             "prompt, while a progressive prefill compresses each layer after every chunk"),
            (self.route_rule is not None, f"{WHERE}.route picks branches per layer from the whole prompt"),
            (self.head_allocator.registry_name != "uniform", f"{WHERE}.allocate.head = "
             f"{self.head_allocator.registry_name} gives the heads of a sample different counts, and the "
             "entries kept between chunks are held as one row per sample"),
            (self.modality_allocator.registry_name != "none", f"{WHERE}.allocate.modality splits by "
             "modality, and a progressive prefill runs text models only"),
            (self.decode_policy.registry_name != "none", f"{WHERE}.decode = "
             f"{self.decode_policy.registry_name} is seeded by one compression of the prompt, not one per "
             "chunk"),
            (bool(self.capabilities.model_facts), f"{next(iter(self.capabilities.model_facts.values()), '')} "
             "reads a model fact at the prompt's positions, which a progressive prefill's kept entries do "
             "not hold in order"),
            (bool(self.capabilities.unchunked), f"{self.capabilities.unchunked[0].field} "
             f"({self.capabilities.unchunked[0].name}) needs the attention of queries a progressive prefill "
             "does not keep" if self.capabilities.unchunked else ""),
        ]  # fmt: skip
        for refused, why in refusals:
            if refused:
                raise ConfigError(
                    f"{where} = progressive cannot run here: {why}. Use `{where}: {{name: once}}` (the "
                    'default), or change that field (docs/architecture.md, "Prefill modes").'
                )
        observers = [
            p for p in self.walk() if p.kind == "scorer" and "window" in p.component.budget_settings.values()
        ]
        if observers and (self.budget.window_is_ratio or int(self.budget.window) < 1):
            raise ConfigError(
                f"{where} = progressive: {observers[0].field} observes {WHERE}.budget.window, which must be "
                f"a number of tokens >= 1 here (got {self.budget.window!r}): each chunk's window queries "
                "are held over to the next chunk, and only a fixed, protected window is sure to stay kept."
            )

    def bind_model(self, model: str) -> None:
        """Tell components that load per-model artefacts which model runs; fails fast on a mismatch.

        Also refuses a model with sliding-window layers when ``sliding_layers: compress`` would hand
        them to a component that cannot compress one (``compresses_sliding_layers``), and a model whose
        config cannot provide a model fact a component reads
        (:func:`~kvlab.models.facts.check_config_facts`; a model whose config is not readable
        here is checked when it loads, before the prefill). Called before the model loads
        (``KVLabModule``) and again by ``generate`` (idempotent).
        """
        if self.bound_model == model:
            return
        readers = self.capabilities.model_facts
        config = model_config(model) if readers else None
        if config is not None:
            check_config_facts(config, model, readers)
        shape = model_shape(model)  # read from the model's config, no weights; {} when unknown
        if self.sliding_layers == "compress" and shape.get("sliding_layers"):
            for part in self.walk():
                if not part.component.compresses_sliding_layers:
                    raise ConfigError(
                        f"{part.field} ({part.component.registry_name}) cannot compress a sliding-window "
                        f"layer, and {WHERE}.sliding_layers = compress hands it the "
                        f"{shape['sliding_layers']} sliding-window layers of {model!r}: set "
                        f"{WHERE}.sliding_layers: window (the default: those layers keep their window), or "
                        "choose another component."
                    )
        for part in self.walk():
            part.component.bind_model(model, shape)
        self.bound_model = model

    @property
    def compresses(self) -> bool:
        """False for the full cache (no scorer configured, in no branch)."""
        return bool(self.importance or self.diversity) or any(b.compresses for b in self.branches.values())

    @property
    def keeps_full_cache(self) -> bool:
        """True when every prompt entry stays as the full cache holds it: nothing is evicted or
        merged (:attr:`compresses`), quantized or channel-pruned, in no branch. Only then are the
        run's outputs the full cache's by construction (its own fidelity reference); a pipeline
        that only quantizes does not compress but changes every entry."""
        return (
            not self.compresses
            and self.quantizer is None
            and self.channel_pruner is None
            and all(b.keeps_full_cache for b in self.branches.values())
        )

    @classmethod
    def _routed(cls, node: dict[str, Any]) -> Pipeline:
        """A pipeline whose layers go to branches (parent node + branch fields) chosen by a rule."""
        where = f"{WHERE}.route"
        route = node["route"]
        check_route_node(route, where)
        parent = {k: v for k, v in node.items() if k != "route"}
        budget = Budget.from_config(parent["budget"]) if parent.get("budget") is not None else None
        rule = build_component(ROUTE_RULES, route["rule"], f"{where}.rule", budget)
        branches = {}
        for name, branch in route["branches"].items():
            branch = check_branch_node(branch, f"{where}.branches.{name}", rule.per_head)
            branches[name] = cls._from_node(merge(parent, branch))
            allocator = branches[name].layer_allocator
            if allocator.capabilities.needs_all_layers:
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
        pipeline = cls._from_node(parent)
        pipeline.route_rule = rule
        pipeline.branches = branches
        return pipeline
