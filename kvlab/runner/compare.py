"""``kvlab compare runs/<experiment>``: methods x metrics, and quality against memory.

Every subdirectory of the experiment holding a ``predictions.jsonl`` is a run (``reference/``
and the outputs below are not). Its aggregates are recomputed from the per-sample records
with the same :class:`~kvlab.metrics.run.RunMetrics` that wrote ``metrics.json``, so the
table equals the runs' ``metrics.json`` and includes samples added by a resumed run.

Writes into the experiment directory:

- ``compare.md`` and ``compare.csv``: the table (also printed);
- ``quality_vs_memory.png``: each quality metric against the kept KV fraction, one line per
  method family (the points of a sweep, :func:`kvlab.config.sweep.parse_method`);
- ``compare/tensorboard/<family>/``: TensorBoard scalars ``sweep/<metric>`` whose step is the
  kept KV in per mille (``round(1000 * kv_ratio)``), so TensorBoard draws one quality-vs-memory
  curve per family, and the figure as ``sweep/quality_vs_memory``.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.sweep import parse_method
from kvlab.metrics.run import summarize
from kvlab.metrics.tasks import TASK_METRICS
from kvlab.runner.writer import PREDICTIONS, read_predictions

FIDELITY = ("fidelity_exact", "fidelity_token_match", "fidelity_rouge_l", "fidelity_kl", "fidelity_top1")
COST = (
    "compression_over_prefill",
    "decode_tokens_per_second",
    "kv_bytes_allocated_peak",
    "peak_memory_bytes",
)
QUALITY = ("fidelity_top1", "fidelity_token_match", "fidelity_kl", *TASK_METRICS)
TB_DIR = Path("compare") / "tensorboard"


@dataclass
class Run:
    """One method's run: its directory name, family and swept values, and recomputed metrics."""

    method: str
    family: str
    point: dict[str, str]
    metrics: dict[str, Any]


def _sort_key(run: Run) -> tuple:
    values = []
    for value in run.point.values():
        try:
            values.append((0, float(value), ""))
        except ValueError:
            values.append((1, 0.0, value))
    return (run.family, values)


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
        runs.append(Run(path.name, family, point, summarize(read_predictions(path))))
    if not runs:
        raise ConfigError(
            f"kvlab compare: no runs in {root} (no subdirectory holds a {PREDICTIONS}); "
            "run `kvlab predict --run.experiment NAME ...` first."
        )
    return sorted(runs, key=_sort_key)


def columns(runs: list[Run]) -> list[str]:
    """``samples``, ``kv_ratio``, the fidelity and task metrics some run has, then cost."""
    present = set().union(*(r.metrics for r in runs))
    keys = ["samples", "kv_ratio", *FIDELITY, *TASK_METRICS, *COST]
    return [k for k in keys if k in present]


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(runs: list[Run], keys: list[str]) -> list[list[str]]:
    """Rows ``[method, *values]`` (``n/a`` where a run lacks a metric)."""
    return [[r.method, *(_cell(r.metrics.get(k)) for k in keys)] for r in runs]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def _csv(header: list[str], rows: list[list[str]]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *rows])
    return out.getvalue()


def quality_metrics(runs: list[Run]) -> list[str]:
    """Quality metrics to plot: those in :data:`QUALITY` that some run has."""
    return [k for k in QUALITY if any(k in r.metrics for r in runs)]


def families(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs per family, ordered by kept KV fraction."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.family, []).append(run)
    return {k: sorted(v, key=lambda r: r.metrics.get("kv_ratio", 0.0)) for k, v in out.items()}


def plot(runs: list[Run], path: Path) -> Any:
    """Figure of every quality metric against ``kv_ratio`` (one panel per metric), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = quality_metrics(runs)
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4 * max(len(metrics), 1), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=False):
        for family, members in families(runs).items():
            xs = [r.metrics["kv_ratio"] for r in members if metric in r.metrics]
            ys = [r.metrics[metric] for r in members if metric in r.metrics]
            if xs:
                ax.plot(xs, ys, marker="o", label=family)
        ax.set_xlabel("KV kept / full")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def write_tensorboard(runs: list[Run], root: Path, figure: Any) -> None:
    """Quality-vs-memory scalars per family (step = kept KV per mille) and the figure."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(root, ignore_errors=True)  # our own output: rewritten whole on every compare
    for family, members in families(runs).items():
        writer = SummaryWriter(str(root / family))
        for run in members:
            step = round(1000 * run.metrics.get("kv_ratio", 0.0))
            for metric in quality_metrics(runs):
                if metric in run.metrics:
                    writer.add_scalar(f"sweep/{metric}", run.metrics[metric], step)
        writer.close()
    writer = SummaryWriter(str(root / "_figure"))
    writer.add_figure("sweep/quality_vs_memory", figure, 0)
    writer.close()


def compare_experiment(experiment: str | Path, plots: bool = True) -> str:
    """Write the comparison files of an experiment; returns the Markdown table."""
    root = Path(experiment)
    runs = load_runs(root)
    keys = columns(runs)
    header, rows = ["method", *keys], table(runs, keys)
    text = markdown(header, rows)
    (root / "compare.md").write_text(text)
    (root / "compare.csv").write_text(_csv(header, rows))
    if plots and quality_metrics(runs):
        figure = plot(runs, root / "quality_vs_memory.png")
        write_tensorboard(runs, root / TB_DIR, figure)
    return text


def main(args: list[str]) -> None:
    """``kvlab compare``."""
    parser = argparse.ArgumentParser(prog="kvlab compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", help="an experiment directory, runs/<experiment>")
    parser.add_argument("--no-plots", action="store_true", help="table only (no PNG, no TensorBoard)")
    ns = parser.parse_args(args)
    print(compare_experiment(ns.experiment, plots=not ns.no_plots), end="")
    written = "compare.md, compare.csv" + ("" if ns.no_plots else ", quality_vs_memory.png")
    print(f"kvlab: wrote {written} in {ns.experiment}")
