"""Standard long-context benchmark suites as kvlab datasets (docs/benchmark_suites.md).

Importing this package registers the datasets ``ruler`` (generated offline), ``longbench``,
``longbench_v2``, ``infinitebench``, ``loogle``, ``math500``, ``aime25``, ``scbench`` (read from a
download or the Hub) and ``needle_haystack``
(generated offline); their metrics live in :mod:`kvlab.metrics.suites`.
:func:`needle_heatmap` draws the needle grid's heatmap from a run's predictions, and
:func:`task_scores` tabulates any suite's scores per task (:func:`longbench_e_scores`:
LongBench-E's length buckets).
"""

from __future__ import annotations

from kvlab.data.benchmarks.infinitebench import InfiniteBenchDataset
from kvlab.data.benchmarks.longbench import LongBenchDataset
from kvlab.data.benchmarks.longbench_v2 import LongBenchV2Dataset
from kvlab.data.benchmarks.loogle import LooGLEDataset
from kvlab.data.benchmarks.math import Aime25Dataset, Math500Dataset
from kvlab.data.benchmarks.needle import NeedleHaystack, needle_grid, needle_heatmap
from kvlab.data.benchmarks.report import longbench_e_scores, longbench_v2_scores, task_scores, task_table
from kvlab.data.benchmarks.ruler import RulerDataset
from kvlab.data.benchmarks.scbench import SCBenchDataset

__all__ = [
    "Aime25Dataset",
    "InfiniteBenchDataset",
    "LongBenchDataset",
    "LongBenchV2Dataset",
    "LooGLEDataset",
    "Math500Dataset",
    "NeedleHaystack",
    "RulerDataset",
    "SCBenchDataset",
    "longbench_e_scores",
    "longbench_v2_scores",
    "needle_grid",
    "needle_heatmap",
    "task_scores",
    "task_table",
]
