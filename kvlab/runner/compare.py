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
- ``compare/tensorboard/``: ``<family>/`` scalars ``sweep/<metric>`` whose step is the kept KV
  in per mille (``round(1000 * kv_ratio)``), ``leaderboard/<method>/`` scalars
  ``leaderboard/<family>_vs_<ratio|tokens>`` whose step is the budget (per mille of a ratio, or
  tokens), and the figures under ``_figure/``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from kvlab.data.benchmarks.report import LONGBENCH_E_BUCKETS, longbench_e_scores
from kvlab.metrics.tasks import TASK_METRICS
from kvlab.runner.leaderboard import (
    FULL,
    BudgetPoint,
    Leaderboard,
    csv_text,
    leaderboard,
    leaderboard_text,
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
    """Figure of every quality metric against ``kv_ratio`` (one panel per metric), saved as PNG."""
    plt = pyplot()
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


# ---------------------------------------------------------------------------------------------
# kept-position overlap


def positions_overlap(runs: list[Run]) -> list[list[str]]:
    """``[run a, run b, mean Jaccard, mean Jaccard at the end, samples, skipped, note]`` for every pair
    of runs that recorded kept positions, whatever their protocols
    (:func:`kvlab.runner.positions.mean_jaccard`): the kept sets after the prefill, over the prompt
    positions both runs compressed (the context, when one compressed the context alone), and the
    same at the end of generation (``decode_time``'s evictions included). A pair with nothing
    comparable gets ``n/a`` and the reason."""
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


def write_tensorboard(runs: list[Run], root: Path, figure: Any, board: Leaderboard | None = None,
                      board_figures: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Quality-vs-memory scalars per family (step = kept KV per mille), the leaderboard's scores per
    method (step = budget: per mille of a ratio, or tokens), and the figures."""
    shutil.rmtree(root, ignore_errors=True)  # our own output: rewritten whole on every compare
    for family, members in families(runs).items():
        writer = SummaryWriter(str(root / family))
        for run in members:
            step = round(1000 * run.metrics.get("kv_ratio", 0.0))
            for metric in quality_metrics(runs):
                if metric in run.metrics:
                    writer.add_scalar(f"sweep/{metric}", run.metrics[metric], step)
        writer.close()
    if board is not None:
        by_method: dict[str, list[tuple[str, BudgetPoint, float]]] = {}
        for family, rows in board.scores.items():
            for method, values in rows.items():
                for budget in board.budgets:
                    if budget.label in values and budget.kind != FULL:
                        by_method.setdefault(method, []).append((family, budget, values[budget.label]))
        for method, entries in by_method.items():
            writer = SummaryWriter(str(root / "leaderboard" / method))
            for family, budget, value in entries:
                step = round(1000 * budget.value) if budget.kind == "ratio" else int(budget.value)
                writer.add_scalar(f"leaderboard/{family}_vs_{budget.kind}", value, step)
            writer.close()
    writer = SummaryWriter(str(root / "_figure"))
    if figure is not None:
        writer.add_figure("sweep/quality_vs_memory", figure, 0)
    for kind, fig in (board_figures or {}).items():
        writer.add_figure(f"leaderboard/score_vs_{kind}", fig, 0)
    writer.close()


def write_comparison(root: Path, plots: bool = True) -> tuple[str, list[str]]:
    """Write the comparison files; returns the Markdown and the names of the files written."""
    runs = load_runs(root)
    stale_files = [root / "leaderboard.csv", root / "positions_overlap.csv", root / "longbench_e.csv"]
    for stale in [*root.glob("score_vs_*.png"), *stale_files]:
        stale.unlink(missing_ok=True)  # our own outputs of an earlier compare
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
        figure = None
        if quality_metrics(runs):
            figure = plot(runs, root / "quality_vs_memory.png")
            written.append("quality_vs_memory.png")
        board_figures = {}
        for kind in sorted({b.kind for b in board.budgets} - {FULL}) if board is not None else []:
            title = f"{root.name}: task score vs KV budget"
            board_figures[kind] = plot_leaderboard(board, kind, root / f"score_vs_{kind}.png", title)
            written.append(f"score_vs_{kind}.png")
        if figure is not None or board_figures:
            write_tensorboard(runs, root / TB_DIR, figure, board, board_figures)
            written.append(str(TB_DIR))
    return text, written


def compare_experiment(experiment: str | Path, plots: bool = True) -> str:
    """Write the comparison files of an experiment; returns the Markdown (table, leaderboard, overlap)."""
    return write_comparison(Path(experiment), plots)[0]
