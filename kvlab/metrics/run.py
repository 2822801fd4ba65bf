"""All metrics of a run, updated from prediction records (during the run and when re-read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.config.registry import record_fields
from kvlab.metrics.cost import CostMetrics
from kvlab.metrics.fidelity import GreedyAgreement, TeacherForcedAgreement
from kvlab.metrics.means import SampleMeans
from kvlab.metrics.tasks import TaskScores


class ReportedMetrics(SampleMeans):
    """The run figures of the record fields components declare with a ``metric``
    (:class:`kvlab.config.capabilities.RecordField`): each field's mean or sum over the records
    that hold a number there, under the field's name (sums and counts: exact under DDP)."""

    def __init__(self, **kwargs: Any):
        aggregates = {name: f.metric for name, f in record_fields().items() if f.metric is not None}
        super().__init__(tuple(aggregates), **kwargs)
        self.aggregates = aggregates  #: field -> ``mean`` or ``sum``

    def update_records(self, records: Sequence[dict[str, Any]]) -> None:
        """Update from prediction records (a value that is not a number is not counted)."""
        super().update_records([{k: v for k, v in r.items() if isinstance(v, int | float)} for r in records])

    def compute(self) -> dict[str, float]:
        sums = {n: float(getattr(self, f"{n}_sum")) for n, a in self.aggregates.items() if a == "sum"}
        return {n: sums.get(n, m) for n, m in super().compute().items()}


class RunMetrics(torch.nn.Module):
    """Fidelity, task and cost metrics of one run.

    ``update(records)`` feeds a batch's prediction records; ``compute()`` returns the flat
    ``metrics.json`` dict (``samples`` first; keys documented in ``docs/evaluation.md``).
    Under DDP, ``compute`` reduces every metric's states over the ranks.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cost = CostMetrics()
        self.greedy = GreedyAgreement()
        self.teacher = TeacherForcedAgreement()
        self.task = TaskScores()
        self.reported = ReportedMetrics()

    def update(self, records: Sequence[dict[str, Any]]) -> None:
        for metric in (self.cost, self.greedy, self.teacher, self.task, self.reported):
            metric.update_records(list(records))

    def reset(self) -> None:
        for metric in (self.cost, self.greedy, self.teacher, self.task, self.reported):
            metric.reset()

    def compute(self) -> dict[str, Any]:
        # compute() reduces the states over DDP ranks; reading a state directly would not
        cost = self.cost.compute() if self.cost.update_called else {}
        out: dict[str, Any] = {"samples": int(cost.pop("samples", 0))}
        for metric in (self.task, self.greedy, self.teacher):
            if metric.update_called:
                out.update(metric.compute())
        out.update(cost)
        if self.reported.update_called:
            out.update(self.reported.compute())
        return out


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``metrics.json`` dict of a list of prediction records."""
    metrics = RunMetrics()
    metrics.update(records)
    return metrics.compute()
