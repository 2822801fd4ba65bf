"""The benchmark suites' task metrics, one module per suite, as their official code scores them.

Each module registers its metrics in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported;
importing this package (``kvlab.metrics`` does) registers them all. The text primitives they
share live in :mod:`kvlab.metrics.text` (normalisation, F1), :mod:`kvlab.metrics.rouge` and
:mod:`kvlab.metrics.bleu`. Which official commit each follows: ``docs/benchmark_suites.md``.
"""

from kvlab.metrics.suites import (
    infinitebench,
    longbench,
    longbench_v2,
    loogle,
    math,
    needle,
    ruler,
    scbench,
    vlm,
)

__all__ = [
    "infinitebench",
    "longbench",
    "longbench_v2",
    "loogle",
    "math",
    "needle",
    "ruler",
    "scbench",
    "vlm",
]
