"""All metrics of a run, updated from prediction records (during the run and when re-read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchmetrics import Metric

from kvlab.config.registry import record_fields
from kvlab.metrics.cost import CostMetrics
from kvlab.metrics.fidelity import GreedyAgreement, TeacherForcedAgreement
from kvlab.metrics.means import record_values
from kvlab.metrics.tasks import TaskScores


class ReportedMetrics(Metric):
    """The run figures of the record fields components declare with a ``metric``
    (:class:`kvlab.config.capabilities.RecordField`): each field's mean, sum or max over the
    records that hold a number there, under the field's name. States are sums, counts and maxima:
    exact under DDP."""

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        #: field -> its aggregate, for every declared field with one
        self.aggregates = {name: f.metric for name, f in record_fields().items() if f.metric is not None}
        for name in self.aggregates:
            self.add_state(f"sum_{name}", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"count_{name}", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"max_{name}", torch.tensor(-torch.inf, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, values: dict[str, torch.Tensor]) -> None:
        """``values``: ``{field: [B] float64}``, NaN where a record has no number."""
        for name, column in values.items():
            present = column[~torch.isnan(column)]
            setattr(self, f"sum_{name}", getattr(self, f"sum_{name}") + present.sum())
            setattr(self, f"count_{name}", getattr(self, f"count_{name}") + present.numel())
            if present.numel():
                setattr(self, f"max_{name}", torch.maximum(getattr(self, f"max_{name}"), present.max()))

    def update_records(self, records: list[dict[str, Any]]) -> None:
        """Update from prediction records (a value that is not a number is not counted)."""
        if records and self.aggregates:
            numbers = [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in records]
            self.update(record_values(numbers, self.aggregates))

    def compute(self) -> dict[str, float]:
        out = {}
        for name, aggregate in self.aggregates.items():
            count = float(getattr(self, f"count_{name}"))
            if count:
                total, most = float(getattr(self, f"sum_{name}")), float(getattr(self, f"max_{name}"))
                out[name] = {"sum": total, "mean": total / count, "max": most}[aggregate]
        return out


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
