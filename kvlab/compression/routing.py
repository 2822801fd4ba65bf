"""Routing: send each layer (per sample) to one of several sub-pipelines by a rule.

A ``route`` node in ``model.compression`` names its branches (partial pipelines merged over
the parent node) and a rule that picks one branch per sample at every layer::

    route:
      rule: {name: latch, metric: {name: ncar}, test: delta_lt, threshold: 0.3,
             before: decoupled, after: unified}
      branches:
        decoupled: {allocate: {modality: {name: decoupled, rho: 2.0}}}
        unified: {}

Rules may read runtime layer metrics (:data:`LAYER_METRICS`) of the current and earlier layers
(a rule keeps its state in the run's :meth:`~kvlab.cache.state.RunState.owned`, one prompt at a
time), which is how DAVID's "decouple
until the NCAR drop falls below a threshold" is plain YAML. Which branch each sample took at
each layer, the metric and the switch are reported per layer (:class:`RouteDecision`) and end
up in the predictions (``route_switch_layer``, ``route_metric``) and TensorBoard through the rule's
:meth:`RouteRule.report`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvlab.compression.context import LayerContext, check_observed_window
from kvlab.compression.decision import RouteDecision
from kvlab.compression.importance import per_window
from kvlab.compression.modality import VISION_GROUP, modality_groups
from kvlab.config import papers
from kvlab.config.capabilities import Component, Outcome, RecordField, Report
from kvlab.config.errors import ConfigError
from kvlab.config.registry import Registry

# ---------------------------------------------------------------------------------------------
# layer metrics


class LayerMetric(Component):
    """Base class: override :meth:`measure` (one value per sample for the current layer).

    ``budget_settings``: parameters restating a budget setting (see :class:`ImportanceScorer`).
    """

    def measure(self, ctx: LayerContext) -> torch.Tensor:
        """``[B]`` float32; NaN where the metric is undefined for a sample."""
        raise NotImplementedError


LAYER_METRICS: Registry[LayerMetric] = Registry("layer metric", "model.compression.route.rule.metric")


@LAYER_METRICS.register("ncar")
@dataclass
class NCARMetric(LayerMetric):
    """DAVID's normalised cross-attention rate (Gu et al. 2026, Eq. 6).

    With A the window attention ``[B, H, r, T]`` of the last ``r = min(window, T_b)`` queries,
    V the vision tokens of sample b (image and video), ``n_V = |V|`` and ``T_b`` its length::

        theta_{b,h} = T_b / (n_V r) * sum_{i<r} sum_{j in V} A[b, h, i, j]      theta_b = mean_h theta_{b,h}

    The sum over j covers every key, window included; the 1/r of Eq. 6 is kept (Alg. 1 drops
    it, which would tie theta to r). theta = 1 when vision gets exactly its share of the
    attention. NaN for a sample without vision tokens (text-only prompts). Reads the memoised
    window scores (``[B, H, T]``, never the ``[B, H, W, T]`` probabilities) that SnapKV-style
    scorers of the same window share. The window is the budget's
    recent window (``budget.window``); ``window`` may restate it but not differ from it.
    """

    paper: ClassVar[str | None] = papers.DAVID

    window: int | None = None

    budget_settings: ClassVar[dict[str, str]] = {"window": "window"}

    def __post_init__(self) -> None:
        check_observed_window(self.window)

    def measure(self, ctx: LayerContext) -> torch.Tensor:
        windows = ctx.observation_windows(self.window, "ncar")  # [B]
        return per_window(windows, lambda window: self._measure(ctx, window))

    def _measure(self, ctx: LayerContext, window: int) -> torch.Tensor:
        """``[B]`` theta of every sample as if its window were ``window``."""
        window = min(window, ctx.seq_len)
        received = ctx.window_attention_scores(window)  # [B, H, T]: sum_i A[b, h, i, j], no [B, H, W, T]
        vision = (modality_groups(ctx.modality) == VISION_GROUP).float()  # [B, T]
        mass = torch.einsum("bht,bt->bh", received, vision).mean(-1)  # [B]
        lengths = ctx.lengths.float()
        rows = torch.clamp(lengths, max=window)
        n_vision = vision.sum(-1)
        theta = lengths * mass / (n_vision * rows)
        return theta.masked_fill(n_vision == 0, float("nan"))


@LAYER_METRICS.register("sink_recent_mass")
@dataclass
class SinkRecentMassMetric(LayerMetric):
    """SimLayerKV's laziness score (Zhang et al. 2024, arXiv 2410.13846, Sec. 3.2, prefill).

    With A the window attention ``[B, H, r, T]`` of the last ``r = min(window, T_b)`` queries of
    sample b (length ``T_b``), S its first ``sinks`` tokens and R its last ``tokens - sinks``
    tokens (the recent window a lazy layer keeps; the queries' own positions are inside it)::

        m_b = 1 / (H r) * sum_h sum_{i<r} sum_{j in S ∪ R} A[b, h, i, j]

    i.e. the attention mass on sinks + recent tokens, averaged over the last queries and the
    query heads; ``m_b`` is in [0, 1] and 1 when the prompt fits in ``tokens``. A layer whose
    ``m`` exceeds the threshold is "lazy" (rule ``threshold``). Reads the memoised window scores
    (``[B, H, T]``) that SnapKV-style scorers of the same window share.

    The three settings restate the budget (one source per setting): ``window`` the last queries
    observed (``budget.window``, the paper's w_last), ``sinks`` (``budget.sinks``, the paper's
    initial tokens) and ``tokens`` (``budget.tokens``: sinks + recent tokens a lazy layer keeps,
    the paper's X_initial + X_recent). Outside a pipeline they must be set.
    """

    paper: ClassVar[str | None] = papers.SIMLAYERKV

    window: int | None = None
    sinks: int | None = None
    tokens: int | None = None

    budget_settings: ClassVar[dict[str, str]] = {"window": "window", "sinks": "sinks", "tokens": "tokens"}
    # a ratio budget does not say how many tokens a lazy layer keeps: refused when the pipeline is built
    required_budget_settings: ClassVar[frozenset[str]] = frozenset({"tokens"})

    def __post_init__(self) -> None:
        check_observed_window(self.window)
        if self.sinks is not None and self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.tokens is not None and self.tokens < (self.sinks or 0):
            raise ValueError(f"tokens must be >= sinks, got tokens={self.tokens}, sinks={self.sinks}")

    def measure(self, ctx: LayerContext) -> torch.Tensor:
        if self.tokens is None:
            raise ConfigError(
                "sink_recent_mass needs the tokens a lazy layer keeps (sinks + recent): set "
                "model.compression.budget.tokens (a ratio budget does not say it), or its own `tokens` "
                "outside a pipeline."
            )
        windows = ctx.observation_windows(self.window, "sink_recent_mass")  # [B]
        return per_window(windows, lambda window: self._measure(ctx, window))

    def _measure(self, ctx: LayerContext, window: int) -> torch.Tensor:
        """``[B]`` mass of every sample as if its window were ``window``."""
        window = min(window, ctx.seq_len)
        received = ctx.window_attention_scores(window)  # [B, H, T]: sum_i A[b, h, i, j]
        sinks = self.sinks or 0
        recent = int(self.tokens) - sinks
        positions = ctx.positions()  # [B, T], -1 on padding
        lengths = ctx.lengths  # [B]
        kept = (positions >= 0) & ((positions < sinks) | (positions >= (lengths - recent)[:, None]))  # [B, T]
        mass = torch.einsum("bht,bt->bh", received, kept.float()).mean(-1)  # [B]
        rows = torch.clamp(lengths, max=window).float()  # real query rows (padding rows are zero)
        return mass / rows.clamp(min=1)


# ---------------------------------------------------------------------------------------------
# rules


class RouteRule(Component):
    """Base class: override :meth:`decide`; ``branch_names`` lists the branches a rule refers to.

    ``per_head``: the rule routes each KV head (its decisions carry ``heads``), not each sample;
    its branches then share the layer budget (they may not change ``budget`` or ``allocate.layer``).
    """

    before: str = ""
    after: str = ""
    per_head: ClassVar[bool] = False
    record_fields: ClassVar[dict[str, RecordField]] = {
        "route_switch_layer": RecordField("per-sample rules: the first layer that switched (None: never)"),
        "route_metric": RecordField("per-sample rules: [L] the rule's metric (None: not evaluated)"),
        "route_heads_per_layer": RecordField("per-head rules: {branch: [KV heads routed there, per layer]}"),
    }

    @property
    def branch_names(self) -> tuple[str, ...]:
        return (self.before, self.after)

    def decide(self, ctx: LayerContext) -> RouteDecision:
        """The branch of every sample at layer ``ctx.layer_idx``."""
        raise NotImplementedError

    def report(self, outcome: Outcome) -> Report | None:
        """Per-head rules (HybridKV): each branch's KV heads per layer. Per-sample rules (DAVID): each
        sample's first switched layer and metric per layer, and TensorBoard's
        ``route/switch_layer_mean`` (a sample never switched counts as the number of layers)."""
        layers = outcome.layers
        routes = [r.route for r in layers if r.route is not None]
        if not routes:
            return None
        batch = range(outcome.kv_bytes_kept.shape[0])
        if self.per_head:
            names = routes[0].head_names
            count = lambda b, i: [int((route.heads[b] == i).sum()) for route in routes]  # noqa: E731
            heads = [{name: count(b, i) for i, name in enumerate(names)} for b in batch]
            return Report([{"route_heads_per_layer": h} for h in heads])
        switch: list[int | None] = [None for _ in batch]
        for layer in layers:
            for b, switched in enumerate(layer.route.switched.tolist() if layer.route is not None else ()):
                if switched and switch[b] is None:
                    switch[b] = layer.layer_idx
        samples = [{"route_switch_layer": switch[b], "route_metric": _metrics(layers, b)} for b in batch]
        mean = sum(len(layers) if s is None else s for s in switch) / len(switch)
        return Report(samples, {"route/switch_layer_mean": mean})

    def _decision(self, switched: torch.Tensor, metric: torch.Tensor | None = None) -> RouteDecision:
        names = [self.after if s else self.before for s in switched.tolist()]
        return RouteDecision(names, switched, metric)


ROUTE_RULES: Registry[RouteRule] = Registry("route rule", "model.compression.route.rule")


@ROUTE_RULES.register("layers")
@dataclass
class LayerSplitRule(RouteRule):
    """Static split: layers ``< split`` use ``before``, the others ``after`` (DAVID's ``fixed_split``)."""

    split: int = 0
    before: str = "before"
    after: str = "after"

    def decide(self, ctx: LayerContext) -> RouteDecision:
        switched = torch.full((ctx.batch_size,), ctx.layer_idx >= self.split, dtype=torch.bool, device="cpu")
        return self._decision(switched)


class MetricRule(RouteRule):
    """A rule deciding from a layer metric: its ``metric`` field (a layer-metric node, declared
    by each rule with its default) is built with the rule, after the pipeline filled in what the
    metric restates of the budget."""

    metric: dict[str, Any]
    part_registries: ClassVar[dict[str, Any]] = {"metric": LAYER_METRICS}

    def __post_init__(self) -> None:
        self._metric = LAYER_METRICS.build(self.metric, "model.compression.route.rule.metric")

    def parts(self) -> dict[str, Any]:
        return {"metric": self._metric}


@dataclass
class Latch:
    """A ``latch`` rule's state over one prompt's layers: ``switched [B]`` bool, ``previous [B]`` metric."""

    switched: torch.Tensor
    previous: torch.Tensor


@ROUTE_RULES.register("latch")
@dataclass
class MetricLatchRule(MetricRule):
    """Use ``before`` until a layer metric trips the test, then ``after`` for that layer and all deeper ones.

    DAVID's gate (Alg. 1 lines 15-22), per sample: ``prev = initial`` before layer 0; at each
    layer while not switched, ``m = metric``, ``delta = prev - m``, then ``prev = m``; switch when

    - ``delta_lt``: delta < threshold (Alg. 1, the default: the NCAR drop has levelled off);
    - ``theta_lt``: m < threshold (Fig. 2 caption);
    - ``delta_gt``: delta > threshold ("abrupt drop").

    A sample whose metric is NaN (no vision tokens for NCAR) switches at once, so a text-only
    prompt runs the ``after`` branch everywhere. Once switched, a sample never switches back
    and its metric is not computed again (NaN in the report).
    """

    paper: ClassVar[str | None] = papers.DAVID

    metric: dict[str, Any] = field(default_factory=lambda: {"name": "ncar"})
    test: Literal["delta_lt", "theta_lt", "delta_gt"] = "delta_lt"
    threshold: float = 0.3
    initial: float = 1.0
    before: str = "decoupled"
    after: str = "unified"

    def decide(self, ctx: LayerContext) -> RouteDecision:
        B = ctx.batch_size
        fresh = lambda: Latch(  # the latch is host bookkeeping (it is read on the host every layer)
            torch.zeros(B, dtype=torch.bool, device="cpu"),
            torch.full((B,), float(self.initial), device="cpu"),
        )
        latch = ctx.run.owned(self, fresh)
        switched, prev = latch.switched, latch.previous
        metric = torch.full((B,), float("nan"), device="cpu")
        if not bool(switched.all()):
            value = self._metric.measure(ctx).float().cpu()
            metric = value.masked_fill(switched, float("nan"))
            delta = prev - value
            if self.test == "delta_lt":
                trip = delta < self.threshold
            elif self.test == "theta_lt":
                trip = value < self.threshold
            else:
                trip = delta > self.threshold
            switched = switched | trip | torch.isnan(value)
            prev = torch.where(torch.isnan(value), prev, value)
            latch.switched, latch.previous = switched, prev
        return self._decision(switched.clone(), metric)


@ROUTE_RULES.register("threshold")
@dataclass
class MetricThresholdRule(MetricRule):
    """Each layer on its own: ``above`` where the layer metric exceeds ``threshold``, else ``below``.

    SimLayerKV's layer test (Zhang et al. 2024, arXiv 2410.13846): with ``metric: sink_recent_mass``
    a layer whose last queries put more than delta of their attention on the sinks + recent
    tokens is lazy (``above``). Unlike ``latch`` there is no state: every layer and sample is
    decided afresh, so the lazy layers need not be contiguous. A NaN metric goes ``below``. The
    report's ``switched`` is True where a sample went ``above`` (``route_switch_layer`` is then
    its first such layer) and ``route_metric`` the metric of every layer.
    """

    paper: ClassVar[str | None] = papers.SIMLAYERKV

    metric: dict[str, Any] = field(default_factory=lambda: {"name": "sink_recent_mass"})
    threshold: float = 0.9
    above: str = "lazy"
    below: str = "full"

    @property
    def branch_names(self) -> tuple[str, ...]:
        return (self.below, self.above)

    def decide(self, ctx: LayerContext) -> RouteDecision:
        value = self._metric.measure(ctx).float().cpu()  # [B]; the branch names are host strings
        over = value > self.threshold  # NaN compares False: below
        names = [self.above if o else self.below for o in over.tolist()]
        return RouteDecision(names, over, value)


def _metrics(layers: Sequence[Any], b: int) -> list[float | None]:
    """Sample ``b``'s route metric at every layer (None: not routed, not evaluated or NaN)."""
    values: list[float | None] = []
    for layer in layers:
        metric = None if layer.route is None or layer.route.metric is None else float(layer.route.metric[b])
        values.append(None if metric is None or math.isnan(metric) else metric)
    return values
