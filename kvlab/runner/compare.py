"""The comparison of an experiment's runs (``kvlab compare``): methods x metrics, a methods x budget
leaderboard, and plots.

Every subdirectory of the experiment holding a ``predictions.jsonl`` is a run (``reference/``
and the outputs below are not). Its aggregates are recomputed from the per-sample records
with the same :class:`~kvlab.metrics.run.RunMetrics` that wrote ``metrics.json``, so the
table equals the runs' ``metrics.json`` and includes samples added by a resumed run.

Writes into the experiment directory (``docs/evaluation.md``, "Comparing runs"):

- ``compare.md`` (also printed): the methods x metrics table (``compare.csv``), then the
  leaderboard and the kept-position overlap below;
- the **leaderboard** (``leaderboard.csv``, :mod:`kvlab.runner.leaderboard`): the task score (%)
  of each method (rows) at each budget (columns, read from each run's ``run.json``), per task
  family and overall; ``score_vs_<ratio|tokens>.png``: score against budget, one panel per
  family, one line per method, the full cache dashed;
- ``quality_vs_memory.png``: each quality metric against the kept KV fraction, one line per
  method family (the points of a sweep, :func:`kvlab.runner.run_names.parse_method`);
- ``longbench_e.csv``: for runs of LongBench-E tasks, each task's ``longbench_score`` per length
  bucket (``0-4k``, ``4-8k``, ``8k+``; LongBench's ``scorer_e``, NaN for an empty bucket);
- ``positions_overlap.csv``: for runs that recorded kept positions (``model.record_positions``),
  the mean Jaccard index of every pair over their shared samples, layers and KV heads;
- ``compare/tensorboard/``: the figures as images (``sweep/quality_vs_memory``,
  ``leaderboard/score_vs_<ratio|tokens>``: curves drawn once, never smoothed) and ``compare.md``
  as TEXT ``compare``; each run's own HPARAMS trial compares the runs' settings and metrics
  (:mod:`kvlab.runner.views.hparams`).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from kvlab.data.benchmarks.report import LONGBENCH_E_BUCKETS, longbench_e_scores
from kvlab.metrics.tasks import TASK_METRICS
from kvlab.runner.leaderboard import (
    FULL,
    csv_text,
    leaderboard,
    leaderboard_text,
    legend_entries,
    markdown,
    plot_leaderboard,
    pyplot,
)
from kvlab.runner.positions import mean_jaccard, read_positions
from kvlab.runner.runs import Run, load_runs

FIDELITY = ("fidelity_exact", "fidelity_token_match", "fidelity_rouge_l", "fidelity_kl", "fidelity_top1")
COST = (
    "compression_over_prefill",
    "decode_tokens_per_second",
    "kv_bytes_allocated_peak",
    "peak_memory_bytes",
)
LONGBENCH_E_HEADER = ["method", "task", *LONGBENCH_E_BUCKETS]
QUALITY = ("fidelity_top1", "fidelity_token_match", "fidelity_kl", *TASK_METRICS)
TB_DIR = Path("compare") / "tensorboard"


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
    """Figure of every quality metric against ``kv_ratio`` (a panel per metric, at most three per
    row, one line per family, the legend beside them), saved as PNG."""
    plt = pyplot()
    metrics = quality_metrics(runs)
    cols = min(3, max(len(metrics), 1))
    rows = math.ceil(max(len(metrics), 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1.6, 3.4 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for family, members in families(runs).items():
            xs = [r.metrics["kv_ratio"] for r in members if metric in r.metrics]
            ys = [r.metrics[metric] for r in members if metric in r.metrics]
            if xs:
                ax.plot(xs, ys, marker="o", label=family)
        ax.set_xlabel("KV kept / full (bytes)")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    fig.legend(*legend_entries(axes.flat), loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig


# ---------------------------------------------------------------------------------------------
# kept-position overlap


def positions_overlap(runs: list[Run]) -> list[list[str]]:
    """``[run a, run b, mean Jaccard, mean Jaccard at the end, samples, skipped, note]`` for every pair
    of runs that recorded kept positions, whatever their protocols
    (:func:`kvlab.runner.positions.mean_jaccard`): the kept sets after the prefill, over the prompt
    positions both runs compressed (the context, when one compressed the context alone), and the
    same at the end of generation (``decode_time``'s and evicting decode policies' evictions
    included). A pair with nothing comparable gets ``n/a`` and the reason."""
    recorded = {r.method: read_positions(r.path) for r in runs if r.path is not None}
    recorded = {k: v for k, v in recorded.items() if v}
    names = sorted(recorded)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            o = mean_jaccard(recorded[a], recorded[b])
            means = ["n/a" if m is None else f"{m:.4f}" for m in (o.mean, o.mean_end)]
            rows.append([a, b, *means, str(o.samples), str(o.skipped), o.reason or ""])
    return rows


POSITIONS_HEADER = [
    "run_a",
    "run_b",
    "mean_jaccard",
    "mean_jaccard_end",
    "samples",
    "skipped_samples",
    "note",  # why a pair has nothing comparable
]


# ---------------------------------------------------------------------------------------------


def write_tensorboard(root: Path, text: str, figures: dict[str, Any]) -> None:
    """The comparison in TensorBoard, rewritten whole: each figure as an image (a curve drawn once,
    so no smoothing or outlier setting can bend it) and the Markdown tables as TEXT ``compare``."""
    shutil.rmtree(root, ignore_errors=True)  # our own output: rewritten whole on every compare
    writer = SummaryWriter(str(root))
    try:
        writer.add_text("compare", text, 0)
        for tag, fig in figures.items():
            writer.add_figure(tag, fig, 0)
    finally:
        writer.close()


def write_comparison(root: Path, plots: bool = True) -> tuple[str, list[str]]:
    """Write the comparison files; returns the Markdown and the names of the files written."""
    runs = load_runs(root)
    stale_files = [root / "leaderboard.csv", root / "positions_overlap.csv", root / "longbench_e.csv"]
    for stale in [*root.glob("score_vs_*.png"), root / "quality_vs_memory.png", *stale_files]:
        stale.unlink(missing_ok=True)  # our own outputs of an earlier compare
    shutil.rmtree(root / TB_DIR, ignore_errors=True)  # its TEXT and figures, even under --no-plots
    outputs: dict[str, str] = {}
    keys = columns(runs)
    header, rows = ["method", *keys], table(runs, keys)
    text = markdown(header, rows)
    outputs["compare.csv"] = csv_text(header, rows)
    board = leaderboard(runs)
    if board is not None:
        section, outputs["leaderboard.csv"] = leaderboard_text(board)
        text += section
    buckets = [[r.method, task, *(_cell(v[b]) for b in LONGBENCH_E_BUCKETS)]
               for r in runs for task, v in longbench_e_scores(r.records).items()]  # fmt: skip
    if buckets:
        text += "\n## LongBench-E: longbench_score (%) per length bucket (LongBench's scorer_e)\n\n"
        text += markdown(LONGBENCH_E_HEADER, buckets)
        outputs["longbench_e.csv"] = csv_text(LONGBENCH_E_HEADER, buckets)
    overlap = positions_overlap(runs)
    if overlap:
        text += "\n## Kept positions: mean Jaccard over shared samples, layers, heads and contexts\n\n"
        text += markdown(POSITIONS_HEADER, overlap)
        outputs["positions_overlap.csv"] = csv_text(POSITIONS_HEADER, overlap)
    outputs["compare.md"] = text
    for name, content in outputs.items():
        (root / name).write_text(content)
    written = list(outputs)
    if plots:
        figures = {}
        if quality_metrics(runs):
            figures["sweep/quality_vs_memory"] = plot(runs, root / "quality_vs_memory.png")
            written.append("quality_vs_memory.png")
        for kind in sorted({b.kind for b in board.budgets} - {FULL}) if board is not None else []:
            title = f"{root.name}: task score vs KV budget"
            path = root / f"score_vs_{kind}.png"
            figures[f"leaderboard/score_vs_{kind}"] = plot_leaderboard(board, kind, path, title)
            written.append(f"score_vs_{kind}.png")
        write_tensorboard(root / TB_DIR, text, figures)
        written.append(str(TB_DIR))
    return text, written


def compare_experiment(experiment: str | Path, plots: bool = True) -> str:
    """Write the comparison files of an experiment; returns the Markdown (table, leaderboard, overlap)."""
    return write_comparison(Path(experiment), plots)[0]
