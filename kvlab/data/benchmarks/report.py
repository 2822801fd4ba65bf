"""Per-task scores of a benchmark run, as the suites report them.

Each suite reports one number per task: the mean over the task's samples of its metric, x 100
(LongBench's ``eval.py`` rounds to two decimals; RULER averages per task and length). A run's
``metrics.json`` holds means over all samples; :func:`task_scores` regroups the per-sample values
of ``predictions.jsonl`` by ``meta.task`` (and ``meta.length`` for generated suites).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError

__all__ = ["task_scores", "task_table"]


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


def task_scores(
    predictions: str | Path | Iterable[dict[str, Any]], metrics: Sequence[str]
) -> dict[tuple[str, int | None], dict[str, float]]:
    """``{(task, length or None): {metric: 100 x mean, "samples": n}}`` over the records that
    carry each metric (tasks in first-seen order)."""
    sums: dict[tuple[str, int | None], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[tuple[str, int | None], int] = defaultdict(int)
    for record in _records(predictions):
        meta = record.get("meta") or {}
        key = (
            str(meta.get("task", "?")),
            meta.get("length") if meta.get("suite") in ("ruler", "needle_haystack") else None,
        )
        counts[key] += 1
        for name in metrics:
            if record.get(name) is not None:
                sums[key][name].append(float(record[name]))
    return {
        key: {**{m: 100 * sum(v) / len(v) for m, v in sums[key].items()}, "samples": float(counts[key])}
        for key in counts
    }


def task_table(predictions: str | Path | Iterable[dict[str, Any]], metrics: Sequence[str]) -> str:
    """:func:`task_scores` as a Markdown table (rows: task and length; columns: metrics)."""
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
