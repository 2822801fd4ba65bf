"""An experiment's runs as ``kvlab compare`` and the leaderboard read them: one :class:`Run` per
subdirectory holding a ``predictions.jsonl``, its metrics recomputed from the records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.metrics.run import summarize
from kvlab.runner.run_names import parse_method
from kvlab.runner.writer import PREDICTIONS, read_predictions


@dataclass
class Run:
    """One method's run: its directory name, family and swept values, recomputed metrics, and (for
    the leaderboard) its records and recorded fingerprint fields (``run.json``, empty if absent)."""

    method: str
    family: str
    point: dict[str, str]
    metrics: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)
    fields: dict[str, Any] = field(default_factory=dict, repr=False)
    path: Path | None = None


def _sort_key(run: Run) -> tuple:
    values = []
    for value in run.point.values():
        try:
            values.append((0, float(value), ""))
        except ValueError:
            values.append((1, 0.0, value))
    return (run.family, values)


def _fields(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "run.json").read_text()).get("fields") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def load_runs(experiment: str | Path) -> list[Run]:
    """The experiment's runs, grouped by family and ordered by swept value."""
    root = Path(experiment)
    if not root.is_dir():
        raise ConfigError(
            f"kvlab compare: {root} is not a directory; pass runs/<experiment> (a run.dir/run.experiment)."
        )
    runs = []
    for path in sorted(p for p in root.iterdir() if (p / PREDICTIONS).is_file()):
        family, point = parse_method(path.name)
        records = read_predictions(path)
        runs.append(Run(path.name, family, point, summarize(records), records, _fields(path), path))
    if not runs:
        raise ConfigError(
            f"kvlab compare: no runs in {root} (no subdirectory holds a {PREDICTIONS}); "
            "run `kvlab predict --run.experiment NAME ...` first."
        )
    return sorted(runs, key=_sort_key)
