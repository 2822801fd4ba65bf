"""A compression method as one object: its specification, one layer's execution, routed execution.

Above the components (:mod:`kvlab.compression`), below the engine: :mod:`kvlab.pipeline.spec`
(the :class:`Pipeline` dataclass built from ``model.compression``), :mod:`kvlab.pipeline.validation`
(its YAML checks), :mod:`kvlab.pipeline.execution` (one layer), :mod:`kvlab.pipeline.routed`
(routes), :mod:`kvlab.pipeline.report` (:class:`LayerReport`).
"""

from kvlab.pipeline.report import LayerReport
from kvlab.pipeline.spec import Pipeline

__all__ = ["LayerReport", "Pipeline"]
