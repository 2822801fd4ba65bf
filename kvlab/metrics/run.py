"""All metrics of a run, updated from prediction records (during the run and when re-read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.metrics.cost import CostMetrics
from kvlab.metrics.fidelity import GreedyAgreement, TeacherForcedAgreement
from kvlab.metrics.tasks import TaskScores


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

    def update(self, records: Sequence[dict[str, Any]]) -> None:
        for metric in (self.cost, self.greedy, self.teacher, self.task):
            metric.update_records(list(records))

    def reset(self) -> None:
        for metric in (self.cost, self.greedy, self.teacher, self.task):
            metric.reset()

    def compute(self) -> dict[str, Any]:
        # compute() reduces the states over DDP ranks; reading a state directly would not
        cost = self.cost.compute() if self.cost.update_called else {}
        out: dict[str, Any] = {"samples": int(cost.pop("samples", 0))}
        for metric in (self.task, self.greedy, self.teacher):
            if metric.update_called:
                out.update(metric.compute())
        out.update(cost)
        return out


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``metrics.json`` dict of a list of prediction records."""
    metrics = RunMetrics()
    metrics.update(records)
    return metrics.compute()
