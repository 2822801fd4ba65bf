"""``kvlab reference-table --suite vlm``: the VLM presets on the reader tasks with ``smollm2-reader``.

What the suite runs; :func:`kvlab.runner.reference_table.run_suite` runs it. Every VLM preset
(LOOK-M and its merges, DAVID and its hybrids, SparseMM and MixKV on SparseMM, HybridKV, PrefixKV,
MixKV on SnapKV) and the text baselines, at each budget (a ratio of the prompt; each preset keeps
its own window and sinks) under each protocol (``docs/protocols.md``), on the ``reader`` dataset
(:mod:`kvlab.data.reader_tasks`: ``samples_per_task`` samples of each task, the same prompts in
every cell), one ``kvlab predict`` run per cell under ``<dir>/vlm-<protocol>/<method>@budget=
<ratio>/`` (``full`` once per protocol). Tables and figure as the RULER suite's, grouped by task;
``--docs`` replaces the block between the ``<!-- reference-vlm -->`` markers::

    kvlab reference-table --suite vlm --docs docs/evaluation.md --figure docs/figures/reference_vlm.png
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.reader_tasks import READER_TASKS

MODEL = "smollm2-reader"
#: the VLM presets first, then the text baselines (cells run in this order: a cut-short run has
#: the VLM rows)
METHODS = (
    "full",
    "random",
    "snapkv",
    "mixkv_snapkv",
    "lookm",
    "lookm_avg",
    "lookm_pivot",
    "lookm_weighted",
    "lookm_h2o",
    "david",
    "david_h2o",
    "david_mixkv",
    "sparsemm",
    "mixkv_sparsemm",
    "hybridkv",
    "prefixkv",
    "streamingllm",
    "h2o",
    "pyramidkv",
    "adakv",
)
SAMPLES_PER_TASK = 5  # x 4 tasks: 20 samples per cell, one sample moves a cell by 5 points
METRIC = "contains_answer"
GROUPS = (("task", "task"),)


def dataset(ns: argparse.Namespace) -> tuple[dict[str, Any], int, str]:
    """``(the reader dataset node, samples per cell, the caption's description)`` from ``--tasks``
    (default: every reader task) and ``--samples`` (per task, default :data:`SAMPLES_PER_TASK`)."""
    tasks = tuple(t for t in (ns.tasks or ",".join(READER_TASKS)).split(",") if t)
    if not tasks or any(t not in READER_TASKS for t in tasks):
        raise ConfigError(
            f"--tasks with --suite vlm takes reader tasks ({', '.join(READER_TASKS)}), got {ns.tasks!r}."
        )
    samples = SAMPLES_PER_TASK if ns.samples is None else ns.samples
    node = {"name": "reader", "tasks": list(tasks), "samples_per_task": samples, "seed": 0}
    return node, len(tasks) * samples, f"reader tasks {', '.join(tasks)}, {samples} sample(s) per task"
