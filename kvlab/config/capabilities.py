"""What a component needs from the engine, declared once on its class: :class:`Capabilities`.

Every component kind's base class (importance and diversity scorers, mixers, allocators,
selectors, decode policies, route rules and layer metrics) derives from :class:`Component` and
sets ``capabilities`` with the kind's default; a component that differs declares its own
``capabilities = Capabilities(...)`` on its class. The pipeline reads them in one walk over its
components (:meth:`kvlab.pipeline.spec.Pipeline.walk`), and ``kvlab list`` prints them
(:meth:`kvlab.config.registry.Registry.describe`).

Model facts (:data:`MODEL_FACTS`) are what a component may read of the model beyond one layer's
keys, values and queries: the rotary embedding at any position, the queries before rotation, the
layer's projection weights. A component names the ones it reads in ``Capabilities(model_facts=...)``;
the engine provides only those (``LayerContext.facts``), and a model that cannot provide one is
refused before it runs (:mod:`kvlab.models.facts`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import torch

#: A model fact a component may declare in ``Capabilities(model_facts=...)``.
ModelFact = Literal[
    "rotary", "queries_before_rotation", "keys_before_rotation", "projections", "hidden_states"
]

#: What each model fact is (the sentence refusals and ``kvlab list`` use).
MODEL_FACTS: dict[str, str] = {
    "rotary": "the layer's rotary embedding at any position (cos, sin)",
    "queries_before_rotation": "the layer's queries before the rotary embedding",
    "keys_before_rotation": "the layer's keys before the rotary embedding",
    "projections": "the layer's q/k/v/o projection weights",
    "hidden_states": "the layer's attention input (the normed hidden states of every prompt position)",
}
assert set(MODEL_FACTS) == set(get_args(ModelFact))


@dataclass(frozen=True)
class Capabilities:
    """A component's needs. Each field has one default; the component bases set their kind's.

    Attributes:
        chunked_prefill: works when the prompt is prefilled in chunks (``model.prefill_chunk``):
            it reads only keys, values, positions and the queries of the recent ``budget.window``
            (a chunked prefill keeps no older query). Importance and diversity scorers default to
            False (a scorer must say so), every other kind to True.
        needs_all_layers: compares layers, so no layer can be compressed before the last layer's
            prefill: it needs ``model.compression.schedule: global`` (PrefixKV's online threshold,
            HybridKV's global pool).
        observes_layers: a layer allocator with an ``observe(ctx, scores, mixed)`` hook that the
            pipeline runs on every layer under ``schedule: global`` before any is compressed.
        decode_attention: a decode policy that reads each decode step's attention probabilities
            (the engine then has the attention function record them, ``run.take_decode_attention()``).
        reads_question: reads the attention the prompt's question pays to the entries
            (``LayerContext.question_attention``), which only a progressive prefill with
            ``question: true`` provides (``model.compression.prefill``, Finch's kind); a pipeline
            with such a component and no question, or a question and no such component, is refused.
        reads_reconstruction: scores from the model's reconstruction of the prompt
            (:class:`~kvlab.compression.reconstruction.ReconstructionStep`), which only the
            ``reconstruct`` prefill mode runs (KVzip's kind); a pipeline with such a component and
            another prefill mode, or that mode and no such component, is refused.
        model_facts: the model facts the component reads (names of :data:`MODEL_FACTS`), sorted:
            the engine provides them in ``LayerContext.facts`` only when a component declares them,
            and refuses a model that cannot provide one before it runs. ``hidden_states`` covers
            every prompt position, so a component reading it declares ``chunked_prefill=False``.
    """

    chunked_prefill: bool = True
    needs_all_layers: bool = False
    observes_layers: bool = False
    decode_attention: bool = False
    reads_question: bool = False
    reads_reconstruction: bool = False
    model_facts: tuple[ModelFact, ...] = ()

    def __post_init__(self) -> None:
        unknown = [fact for fact in self.model_facts if fact not in MODEL_FACTS]
        if unknown:
            raise ValueError(f"unknown model facts {unknown}; known: {', '.join(MODEL_FACTS)}")
        object.__setattr__(self, "model_facts", tuple(sorted(set(self.model_facts))))
        if "hidden_states" in self.model_facts and self.chunked_prefill:
            raise ValueError(
                "a component reading the model fact hidden_states reads every prompt position's, which a "
                "chunked prefill does not keep: declare chunked_prefill=False"
            )

    def describe(self) -> str:
        """The capabilities that hold, e.g. ``chunked_prefill, decode_attention`` (``none``); model
        facts as ``model_facts=rotary+queries_before_rotation``."""
        held = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is True]
        if self.model_facts:
            held.append("model_facts=" + "+".join(self.model_facts))
        return ", ".join(held) or "none"


@dataclass(frozen=True)
class RecordField:
    """A field a component writes into each sample's prediction record (``record_fields``).

    Attributes:
        about: what the value is (units, shape), as the docs state it.
        metric: how ``metrics.json`` aggregates it over the records that hold a number there
            (``mean`` or ``sum``, under the field's own name); None: not aggregated.
    """

    about: str
    metric: Literal["mean", "sum"] | None = None


@dataclass(frozen=True)
class Outcome:
    """What one batch's compression did, as a component's :meth:`Component.report` reads it.

    Attributes:
        layers: every layer's :class:`kvlab.pipeline.report.LayerReport` (``layer_idx``, ``kept``
            ``[B, Hkv]``, ``budget`` ``[B]``, ``selection``, ``route``), in the order they ran.
        kv_bytes_kept: ``[B]`` bytes of each sample's kept prompt K/V, every layer.
    """

    layers: Sequence[Any]
    kv_bytes_kept: torch.Tensor


@dataclass(frozen=True)
class Report:
    """What a component adds to a batch's records.

    Attributes:
        samples: one ``{field: JSON-ready value}`` per sample of the batch, its fields among the
            component's ``record_fields``; written into the predictions as they are.
        scalars: ``{TensorBoard tag: value}`` of the batch, logged at its step.
    """

    samples: list[dict[str, Any]]
    scalars: dict[str, float] = field(default_factory=dict)


@functools.cache
def parameters(cls: type) -> frozenset[str]:
    """The parameters of a component class: its dataclass fields set at construction."""
    if not dataclasses.is_dataclass(cls):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


class Component:
    """Base of every component kind: its registry name, what it restates of the budget, its
    capabilities, what it reports, and the model-binding hook.

    ``budget_settings`` maps a parameter that restates a budget setting to that setting (e.g.
    ``{"window": "window"}``): when it is unset the pipeline fills it from the budget into the
    component's node before building it, and refuses a config where the two differ; a parameter
    also named in ``required_budget_settings`` must get a token count there, or the pipeline
    refuses the config when it is built (SimLayerKV's lazy-layer tokens cannot come from a ratio
    budget). ``layer_allocator_settings`` does the same for a parameter that restates one of the
    layer allocator's (e.g. ``{"layer": "layer"}``: FastV's scorer ranks at the layer before the
    first one its layer allocator compresses). ``capabilities``: see
    :class:`Capabilities`; a component whose capabilities depend on its parameters sets them on
    the instance in ``__post_init__``.
    ``paper``: the paper the component follows (a constant of :mod:`kvlab.config.papers`), None
    for kvlab's own plumbing (``topk``, ``uniform``). ``record_fields``: the fields
    :meth:`report` writes into each prediction record (see :class:`RecordField`).
    """

    registry_name: str = ""
    #: whether :meth:`seal` froze the parameters
    sealed: ClassVar[bool] = False
    paper: ClassVar[str | None] = None
    budget_settings: ClassVar[dict[str, str]] = {}
    required_budget_settings: ClassVar[frozenset[str]] = frozenset()
    #: route rules (registry names) whose decisions this component reads: the pipeline must be
    #: routed by one of them (empty: none needed)
    needs_route_rule: ClassVar[frozenset[str]] = frozenset()
    #: False: cannot compress a sliding-window layer (refused before the model loads when
    #: ``sliding_layers: compress`` meets a model that has such layers)
    compresses_sliding_layers: ClassVar[bool] = True
    layer_allocator_settings: ClassVar[dict[str, str]] = {}
    #: fields holding the node of a part the component builds itself, by field name -> the
    #: registry it is built from (a route rule's ``metric``): the pipeline fills the budget
    #: settings the part restates in that node before the component is built
    part_registries: ClassVar[dict[str, Any]] = {}
    capabilities: ClassVar[Capabilities] = Capabilities()
    record_fields: ClassVar[dict[str, RecordField]] = {}

    def seal(self) -> None:
        """Freeze this component's parameters (its dataclass fields set at construction): a
        registry seals every component it builds (:meth:`kvlab.config.registry.Registry.build`),
        after the pipeline has filled the parameters it restates into its node; assigning a
        parameter afterwards raises. State a component keeps while it runs is not a parameter and
        stays writable."""
        object.__setattr__(self, "sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.sealed and name in parameters(type(self)):
            raise AttributeError(
                f"{type(self).__name__}.{name} is a parameter of a built component and cannot change; build "
                "another one with the value you want (kvlab.load_pipeline with an override, or the registry)."
            )
        object.__setattr__(self, name, value)

    def parts(self) -> dict[str, Component]:
        """Components this one built from its own fields, by field name (a route rule's ``metric``,
        the ``retrieve`` selector's ``index``): the pipeline's walk lists them under the field, so
        their capabilities, budget settings and reports count. None by default."""
        return {}

    def bind_model(self, model: str, shape: Mapping[str, int] | None = None) -> None:
        """Called with the model name (and its ``num_layers`` / ``num_heads`` / ``num_kv_heads`` /
        ``sliding_layers`` when known, :func:`kvlab.models.shape.model_shape`) before the model
        loads: components reading a per-model calibration artefact check it here, so a wrong one
        fails early; nothing by default."""
        return None

    def report(self, outcome: Outcome) -> Report | None:
        """What this component adds to each record of a batch (fields of ``record_fields``) and to
        TensorBoard, read from every layer's outcome; None (the default): nothing. The pipeline
        asks each component class once per batch (:meth:`kvlab.pipeline.spec.Pipeline.report`),
        so a component that appears in several branches reports over all of them."""
        return None
