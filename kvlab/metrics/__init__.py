"""kvlab's evaluation metrics (torchmetrics ``Metric`` subclasses, exact under DDP reduction).

- :mod:`kvlab.metrics.fidelity`: agreement with the full-cache model (greedy output,
  teacher-forced KL and top-1);
- :mod:`kvlab.metrics.task`: task scores against references (:mod:`kvlab.tasks` registry);
- :mod:`kvlab.metrics.cost`: KV bytes, compression / prefill time, decode speed, peak memory;
- :mod:`kvlab.metrics.reference`: the cached full-cache reference per sample;
- :mod:`kvlab.metrics.run`: :class:`RunMetrics`, all of them over a run's prediction records.

Definitions: ``docs/evaluation.md``.
"""
