"""A pipeline's capabilities, read in one walk over its components.

Every component declares its :class:`~kvlab.config.capabilities.Capabilities` on its class;
:meth:`kvlab.pipeline.spec.Pipeline.walk` lists each component with its YAML field (scorers,
slots, the route rule and its parts, then every branch's), and :class:`PipelineCapabilities`
summarises what the engine must know: which components compare layers (``schedule: global``),
which cannot run after a chunked prefill, whether a component reads every prompt query after
the scorers ran, whether the decode policy reads the decode attention, which model facts the
components read (:mod:`kvlab.models.facts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvlab.config.capabilities import Component


class Part(NamedTuple):
    """One component of a pipeline: its YAML field, the component, and what it is there
    (``scorer``: importance / diversity; ``route``: a route rule or one of its parts; ``slot``:
    the mixer, allocators, selector and its index, decode policy)."""

    field: str
    component: Component
    kind: Literal["scorer", "slot", "route"]

    @property
    def name(self) -> str:
        """The component's registry name (its class name when it has none)."""
        return self.component.registry_name or type(self.component).__name__


@dataclass(frozen=True)
class PipelineCapabilities:
    """What a pipeline needs, from its :class:`Part` s.

    Attributes:
        comparing_layers: the parts that need every layer's scores before any is compressed
            (``needs_all_layers``): the pipeline needs ``schedule: global``.
        unchunked: the parts that cannot run after a chunked prefill (``chunked_prefill`` False).
        reads_all_queries: a part other than a scorer or the route reads every prompt query after
            the scorers ran (e.g. the ``h2o`` decode policy's seed): ``schedule: global`` then keeps
            every query of a waiting layer.
        decode_attention: the decode policy reads each decode step's attention.
        fact_readers: the parts that declare model facts (``model_facts``).
    """

    comparing_layers: tuple[Part, ...]
    unchunked: tuple[Part, ...]
    reads_all_queries: bool
    decode_attention: bool
    fact_readers: tuple[Part, ...] = ()

    @property
    def model_facts(self) -> dict[str, str]:
        """Each model fact a part reads -> the first such part, as ``<YAML field> (<name>)`` (the
        engine provides exactly these facts; a model lacking one is refused naming that part)."""
        readers: dict[str, str] = {}
        for part in self.fact_readers:
            for fact in part.component.capabilities.model_facts:
                readers.setdefault(fact, f"{part.field} ({part.name})")
        return readers

    @classmethod
    def of(cls, parts: list[Part]) -> PipelineCapabilities:
        """Summarise ``parts`` (:meth:`kvlab.pipeline.spec.Pipeline.walk`)."""
        unchunked = tuple(p for p in parts if not p.component.capabilities.chunked_prefill)
        return cls(
            comparing_layers=tuple(p for p in parts if p.component.capabilities.needs_all_layers),
            unchunked=unchunked,
            reads_all_queries=any(p.kind == "slot" for p in unchunked),
            decode_attention=any(p.component.capabilities.decode_attention for p in parts),
            fact_readers=tuple(p for p in parts if p.component.capabilities.model_facts),
        )
