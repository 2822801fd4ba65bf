"""Task metrics aggregated over a run: the mean of each task score over the samples it applies to."""

from __future__ import annotations

from typing import Any

from kvlab.metrics.means import SampleMeans
from kvlab.tasks import TASK_METRICS


class TaskScores(SampleMeans):
    """Mean of every registered task metric (:data:`kvlab.tasks.TASK_METRICS`) over the samples
    scored with it. A state per registered name (not per dataset) keeps every DDP rank's
    states identical; names never scored are left out of :meth:`compute`."""

    def __init__(self, **kwargs: Any):
        super().__init__(tuple(TASK_METRICS), **kwargs)
