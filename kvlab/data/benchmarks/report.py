"""Per-task scores of a benchmark run, as the suites report them.

Each suite reports one number per task: the mean over the task's samples of its metric, x 100
(LongBench's ``eval.py`` rounds to two decimals; RULER averages per task and length). A run's
``metrics.json`` holds means over all samples; :func:`task_scores` regroups the per-sample values
of ``predictions.jsonl`` by ``meta.task`` (and ``meta.length`` for generated suites, the length
bucket for LongBench-E).

LongBench-E (Bai et al. 2024) reports each task in three buckets of the example's ``length``
(words): ``0-4k`` (< 4000), ``4-8k`` (< 8000) and ``8k+``, each ``round(100 * np.mean(scores), 2)``
and NaN when empty, as ``scorer_e`` in THUDM/LongBench ``LongBench/eval.py`` (commit 2e00731)
computes them: :func:`longbench_e_scores`. The mean is numpy's, not a left-to-right sum: from
eight values on numpy adds in another order (pairwise summation), the two can differ in the last
bit, and a bucket mean that ends in 5 at the third decimal then rounds the other way.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.config.errors import ConfigError

__all__ = [
    "LONGBENCH_E_BUCKETS",
    "LONGBENCH_V2_SPLITS",
    "longbench_e_bucket",
    "longbench_e_scores",
    "longbench_v2_scores",
    "task_scores",
    "task_table",
]

#: LongBench-E's length buckets (``eval.py``'s ``scorer_e``)
LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")
#: LongBench v2's columns (``result.py``): overall, then by difficulty and by length
LONGBENCH_V2_SPLITS = ("overall", "easy", "hard", "short", "medium", "long")


def _records(predictions: str | Path | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(predictions, str | Path):
        path = Path(predictions)
        path = path / "predictions.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(
                f"no predictions file at {path}; point at a run directory or its predictions.jsonl."
            )
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return list(predictions)


def longbench_e_bucket(length: int | float) -> str:
    """``scorer_e``'s bucket of an example's ``length``: under 4000, under 8000, the rest."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _scorer_e_bucket_score(scores: list[float]) -> float:
    """A bucket's number as ``scorer_e`` writes it, ``round(100 * np.mean(scores), 2)``: numpy's
    mean of the Python list (pairwise summation), then numpy's rounding; NaN for an empty bucket
    (where ``np.mean`` warns and gives NaN)."""
    if not scores:
        return math.nan
    return float(round(100 * np.mean(scores), 2))


def _longbench_e(meta: dict[str, Any]) -> bool:
    task = meta.get("task")
    return meta.get("suite") == "longbench" and isinstance(task, str) and task.endswith("_e")


def _key(meta: dict[str, Any]) -> tuple[str, int | str | None]:
    task = str(meta.get("task", "?"))
    if meta.get("suite") in ("ruler", "needle_haystack"):
        return task, meta.get("length")
    if _longbench_e(meta) and meta.get("length") is not None:
        return task, longbench_e_bucket(meta["length"])
    return task, None


def longbench_e_scores(
    predictions: str | Path | Iterable[dict[str, Any]], metric: str = "longbench_score"
) -> dict[str, dict[str, float]]:
    """``{task: {"0-4k" | "4-8k" | "8k+": round(100 * np.mean(scores), 2)}}`` over a run's
    LongBench-E records (``<task>_e``), NaN for an empty bucket: ``scorer_e``'s numbers, computed
    as it computes them (the scores of a bucket in record order)."""
    values: dict[str, dict[str, list[float]]] = {}
    for record in _records(predictions):
        meta = record.get("meta") or {}
        if not _longbench_e(meta) or meta.get("length") is None:
            continue
        buckets = values.setdefault(str(meta["task"]), {b: [] for b in LONGBENCH_E_BUCKETS})
        if record.get(metric) is not None:
            buckets[longbench_e_bucket(meta["length"])].append(float(record[metric]))
    return {
        task: {bucket: _scorer_e_bucket_score(scores) for bucket, scores in buckets.items()}
        for task, buckets in values.items()
    }


def longbench_v2_scores(
    predictions: str | Path | Iterable[dict[str, Any]], metric: str = "longbench_v2_accuracy"
) -> dict[str, float]:
    """``{"overall" | "easy" | "hard" | "short" | "medium" | "long": round(100 * accuracy, 1)}``
    over a run's LongBench v2 records, as THUDM/LongBench ``result.py`` (commit 2e00731) prints
    them (``compensated = False``); NaN for an empty split (``result.py`` divides by zero)."""
    groups: dict[str, list[float]] = {split: [] for split in LONGBENCH_V2_SPLITS}
    for record in _records(predictions):
        meta = record.get("meta") or {}
        if meta.get("suite") != "longbench_v2" or record.get(metric) is None:
            continue
        value = float(record[metric])
        groups["overall"].append(value)
        groups["easy" if meta.get("difficulty") == "easy" else "hard"].append(value)
        length = meta.get("length")
        groups[length if length in ("short", "medium") else "long"].append(value)
    if not groups["overall"]:
        return {}
    return {split: round(100 * sum(v) / len(v), 1) if v else math.nan for split, v in groups.items()}


def task_scores(
    predictions: str | Path | Iterable[dict[str, Any]], metrics: Sequence[str]
) -> dict[tuple[str, int | str | None], dict[str, float]]:
    """``{(task, length, bucket or None): {metric: 100 x mean, "samples": n}}`` over the records
    that carry each metric (tasks in first-seen order). A LongBench-E task has all three length
    buckets, an empty one with NaN scores (as ``scorer_e``)."""
    sums: dict[tuple[str, int | str | None], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[tuple[str, int | str | None], int] = defaultdict(int)
    for record in _records(predictions):
        meta = record.get("meta") or {}
        key = _key(meta)
        if isinstance(key[1], str):  # a LongBench-E bucket: every bucket of the task is reported
            for bucket in LONGBENCH_E_BUCKETS:
                counts.setdefault((key[0], bucket), 0)
        counts[key] += 1
        for name in metrics:
            if record.get(name) is not None:
                sums[key][name].append(float(record[name]))
    empty = dict.fromkeys(metrics, math.nan)
    return {
        key: {
            **(empty if counts[key] == 0 else {m: 100 * sum(v) / len(v) for m, v in sums[key].items()}),
            "samples": float(counts[key]),
        }
        for key in counts
    }


def task_table(predictions: str | Path | Iterable[dict[str, Any]], metrics: Sequence[str]) -> str:
    """:func:`task_scores` as a Markdown table (rows: task and length or LongBench-E bucket;
    columns: metrics, two decimals as LongBench rounds)."""
    scores = task_scores(predictions, metrics)
    lines = [
        "| task | length | samples | " + " | ".join(metrics) + " |",
        "|---|---|---|" + "---|" * len(metrics),
    ]
    for (task, length), row in scores.items():
        cells = [f"{row[m]:.2f}" if m in row else "-" for m in metrics]
        lines.append(
            f"| {task} | {length if length is not None else '-'} | {int(row['samples'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"
