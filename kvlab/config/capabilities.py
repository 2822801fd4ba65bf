"""What a component needs from the engine, declared once on its class: :class:`Capabilities`.

Every component kind's base class (importance and diversity scorers, mixers, allocators,
selectors, decode policies, route rules and layer metrics) derives from :class:`Component` and
sets ``capabilities`` with the kind's default; a component that differs declares its own
``capabilities = Capabilities(...)`` on its class. The pipeline reads them in one walk over its
components (:meth:`kvlab.pipeline.spec.Pipeline.walk`), and ``kvlab list`` prints them
(:meth:`kvlab.config.registry.Registry.describe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar


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
    """

    chunked_prefill: bool = True
    needs_all_layers: bool = False
    observes_layers: bool = False
    decode_attention: bool = False

    def describe(self) -> str:
        """The capabilities that hold, e.g. ``chunked_prefill, decode_attention`` (``none``)."""
        held = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return ", ".join(held) or "none"


class Component:
    """Base of every component kind: its registry name, what it restates of the budget, its
    capabilities, and the model-binding hook.

    ``budget_settings`` maps a parameter that restates a budget setting to that setting (e.g.
    ``{"window": "window"}``): the pipeline fills it from the budget when it is unset and refuses
    a config where the two differ. ``capabilities``: see :class:`Capabilities`; a component whose
    capabilities depend on its parameters sets them on the instance in ``__post_init__``.
    ``paper``: the paper the component follows (a constant of :mod:`kvlab.config.papers`), None
    for kvlab's own plumbing (``topk``, ``uniform``).
    """

    registry_name: str = ""
    paper: ClassVar[str | None] = None
    budget_settings: ClassVar[dict[str, str]] = {}
    capabilities: ClassVar[Capabilities] = Capabilities()

    def bind_model(self, model: str, shape: Mapping[str, int] | None = None) -> None:
        """Called with the model name (and its ``num_layers`` / ``num_heads`` / ``num_kv_heads``
        when known) before the model loads: components reading a per-model calibration artefact
        check it here, so a wrong one fails early; nothing by default."""
        return None
