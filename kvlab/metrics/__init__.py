"""kvlab's evaluation metrics (torchmetrics ``Metric`` subclasses, exact under DDP reduction).

- :mod:`kvlab.metrics.fidelity`: agreement with the full-cache model (greedy output,
  teacher-forced KL and top-1), from a reference and a run's tokens and logits (the runs
  themselves are made by :mod:`kvlab.runner.fidelity_run`);
- :mod:`kvlab.metrics.tasks`: per-sample task scores (the registry) and their run means;
- :mod:`kvlab.metrics.cost`: KV bytes, compression / prefill time, decode speed, peak memory;
- :mod:`kvlab.metrics.reference`: the cached full-cache reference per sample;
- :mod:`kvlab.metrics.run`: :class:`RunMetrics`, all of them over a run's prediction records;
- :mod:`kvlab.metrics.suites`: the benchmark suites' task metrics (RULER, LongBench, VLM tasks...), one
  module per suite, over the text primitives :mod:`kvlab.metrics.text`,
  :mod:`kvlab.metrics.rouge` and :mod:`kvlab.metrics.bleu`.

The benchmark suites' metric modules register into :data:`kvlab.metrics.tasks.TASK_METRICS`
when imported; this package imports them all, so every ``kvlab.metrics`` import sees every
metric.

Definitions: ``docs/evaluation.md``.
"""

from kvlab.metrics import suites

__all__ = ["suites"]
