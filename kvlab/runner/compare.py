"""The comparison of an experiment's runs (``kvlab compare``): methods x metrics, a methods x budget
leaderboard, and plots.

Every subdirectory of the experiment holding a ``predictions.jsonl`` is a run (``reference/``
and the outputs below are not). Its aggregates are recomputed from the per-sample records
with the same :class:`~kvlab.metrics.run.RunMetrics` that wrote ``metrics.json``, so the
table equals the runs' ``metrics.json`` and includes samples added by a resumed run.

Writes into the experiment directory (``docs/evaluation.md``, "Comparing runs"):

- ``compare.md`` (also printed): the methods x metrics table with short headers and units, each
  run by its display name (:mod:`kvlab.runner.views.names`; ``compare.csv`` keeps the directory
  names, metric keys and raw numbers), then the leaderboard, the kept-position overlap below, and
  each display name beside its run directory;
- the **leaderboard** (``leaderboard.csv``, :mod:`kvlab.runner.leaderboard`): the task score (%)
  of each method (rows) at each budget (columns, read from each run's ``run.json``), per task
  family and overall; ``score_vs_<ratio|tokens>.<family>.png``: score against budget, one card
  per family, one line per method, the full cache dashed;
- ``quality_vs_memory.<metric>.png``: each quality metric against the kept KV fraction, one card
  per metric, one line per method family (the points of a sweep,
  :func:`kvlab.runner.run_names.parse_method`);
- ``longbench_e.csv``: for runs of LongBench-E tasks, each task's ``longbench_score`` per length
  bucket (``0-4k``, ``4-8k``, ``8k+``; LongBench's ``scorer_e``, NaN for an empty bucket);
- ``positions_overlap.csv``: for runs that recorded kept positions (``model.record_positions``),
  the mean Jaccard index of every pair over their shared samples, layers and KV heads;
- ``compare/tensorboard/``: the same figures as images (``quality_vs_memory/<metric>``,
  ``score_vs_<ratio|tokens>/<family>``: the PNG files' pixels, curves drawn once, never
  smoothed), ``compare.md`` as TEXT ``compare``, and the experiment's HPARAMS configuration (the
  column order); each run's HPARAMS trial, renamed here by what varies within the experiment,
  compares the runs' settings and metrics (:mod:`kvlab.runner.views.summary`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from kvlab.data.benchmarks.report import LONGBENCH_E_BUCKETS, longbench_e_scores
from kvlab.metrics.tasks import TASK_METRICS
from kvlab.runner.leaderboard import (
    FULL,
    OVERALL,
    Leaderboard,
    csv_text,
    draw_scores,
    family_methods,
    family_metrics,
    family_order,
    leaderboard,
    leaderboard_text,
    line_styles,
    markdown,
    plot_series,
)
from kvlab.runner.positions import mean_jaccard, read_positions
from kvlab.runner.runs import Run, load_runs
from kvlab.runner.views import write_experiment_summaries
from kvlab.runner.views.figures import card_figure, legend_below, render, save_png, styled
from kvlab.runner.views.names import display_names

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


#: compare.md's short column headers, each with its unit; shares and task scores are in %
HEADERS = {
    "samples": "n",
    "kv_ratio": "KV kept %",
    "fidelity_exact": "fid. exact %",
    "fidelity_token_match": "fid. tokens %",
    "fidelity_rouge_l": "fid. ROUGE-L %",
    "fidelity_kl": "fid. KL nats/tok",
    "fidelity_top1": "fid. top-1 %",
    "compression_over_prefill": "compress/prefill",
    "decode_tokens_per_second": "decode tok/s",
    "kv_bytes_allocated_peak": "KV peak MiB",
    "peak_memory_bytes": "peak MiB",
}
#: keys written as a percentage (shares and task scores in [0, 1])
PERCENT = {"kv_ratio", *(k for k in FIDELITY if k != "fidelity_kl"), *TASK_METRICS}


def score_figures(board: Leaderboard, kind: str, title: str) -> dict[str, Any]:
    """``{family: figure}``: one card per task family (overall first), each the size of a run's
    TensorBoard figures (:mod:`kvlab.runner.views.figures`) with its legend inside the figure, below
    the axes, so the saved PNG and the TensorBoard image are the same picture."""
    order = family_order(board)
    styles = line_styles(
        [m for family in order for m in family_methods(board, family) if m not in board.reference]
    )

    @styled
    def draw(family: str) -> Any:
        methods = len(board.scores[family])
        fig, ax = card_figure(entries=methods)
        moved = draw_scores(ax, board, family, kind, styles)
        name = "overall (mean of families)" if family == OVERALL else family
        ax.set_title(f"{title}\n{name}: {family_metrics(board, family)}")
        legend_below(fig, ax, note="equal points drawn side by side" if moved else None)
        return fig

    return {family: draw(family) for family in order}


def columns(runs: list[Run]) -> list[str]:
    """``samples``, ``kv_ratio``, the fidelity and task metrics some run has, then cost."""
    present = set().union(*(r.metrics for r in runs))
    keys = ["samples", "kv_ratio", *FIDELITY, *TASK_METRICS, *COST]
    return [k for k in keys if k in present]


def header(key: str) -> str:
    """A column's short header with its unit (:data:`HEADERS`; a task metric as ``<name> %``)."""
    return HEADERS.get(key) or (f"{key} %" if key in PERCENT else key)


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def shown_cell(key: str, value: Any) -> str:
    """A value as compare.md shows it under :func:`header`: shares in %, bytes in MiB, rates and
    ratios to a few digits (``compare.csv`` keeps the raw numbers)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return _cell(value)
    if key in PERCENT:
        return f"{100 * value:.1f}"
    if key.endswith("_bytes") or key.startswith("kv_bytes"):
        return f"{value / 2**20:.1f}"
    if key == "decode_tokens_per_second":
        return f"{value:.1f}"
    return _cell(value)


def table(runs: list[Run], keys: list[str]) -> list[list[str]]:
    """Rows ``[method, *values]`` of the raw numbers (``compare.csv``; ``n/a`` where a run lacks a
    metric)."""
    return [[r.method, *(_cell(r.metrics.get(k)) for k in keys)] for r in runs]


#: the line under compare.md's first table: what its abbreviations mean
TABLE_NOTE = (
    "\nfid.: agreement with the full cache (exact output, greedy tokens, ROUGE-L, KL, top-1; "
    "docs/evaluation.md); task scores and shares in %, memory in MiB.\n"
)


def shown_table(runs: list[Run], keys: list[str], names: dict[str, str]) -> str:
    """compare.md's methods x metrics table: each run by its display name, short headers with units."""
    rows = [[names.get(r.method, r.method), *(shown_cell(k, r.metrics.get(k)) for k in keys)] for r in runs]
    return markdown(["method", *(header(k) for k in keys)], rows) + TABLE_NOTE


def quality_metrics(runs: list[Run]) -> list[str]:
    """Quality metrics to plot: those in :data:`QUALITY` that some run has."""
    return [k for k in QUALITY if any(k in r.metrics for r in runs)]


def families(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs per family, ordered by kept KV fraction."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.family, []).append(run)
    return {k: sorted(v, key=lambda r: r.metrics.get("kv_ratio", 0.0)) for k, v in out.items()}


#: a quality metric's axis label (its unit); task metrics are scores in [0, 1]
QUALITY_LABELS = {
    "fidelity_kl": "KL to the full cache (nats/token)",
    "fidelity_top1": "top-1 agreement (share)",
    "fidelity_token_match": "greedy tokens matching (share)",
}


@styled
def quality_figure(runs: list[Run], metric: str, title: str) -> Any:
    """One quality metric against ``kv_ratio``: a line per method family (a sweep's points in order
    of KV kept), each in its own colour and marker, coinciding lines kept visible
    (:func:`~kvlab.runner.leaderboard.plot_series`), the legend inside the figure below the axes;
    the size of a run's TensorBoard figures."""
    groups = families(runs)
    series = {
        family: [(r.metrics["kv_ratio"], r.metrics[metric]) for r in members
                 if metric in r.metrics and "kv_ratio" in r.metrics]
        for family, members in groups.items()
    }  # fmt: skip
    series = {family: points for family, points in series.items() if points}
    styles = line_styles(list(groups))
    fig, ax = card_figure(entries=len(series))
    moved = plot_series(ax, series, styles)
    ax.set_xlabel("KV kept / full (bytes)")
    ax.set_ylabel(QUALITY_LABELS.get(metric, f"{metric} (score)"))
    ax.grid(alpha=0.3)
    ax.set_title(f"{title}\n{metric} vs KV kept")
    legend_below(fig, ax, note="equal points drawn side by side" if moved else None)
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


def write_figures(root: Path, figures: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """Each figure (``{tag: (file name, figure)}``) rendered once: saved as ``root/<file name>`` and
    returned as ``{tag: RGB array}`` for TensorBoard, so the PNG file and the card are the same
    pixels."""
    images = {}
    for tag, (name, fig) in figures.items():
        images[tag] = render(fig)
        save_png(images[tag], root / name)
    return images


def write_tensorboard(root: Path, text: str, images: dict[str, Any]) -> None:
    """The comparison in TensorBoard: each figure as an image (a curve drawn once, so no smoothing
    or outlier setting can bend it) and the Markdown tables as TEXT ``compare``."""
    root.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(root))
    try:
        writer.add_text("compare", text, 0)
        for tag, image in images.items():
            writer.add_image(tag, image, 0, dataformats="HWC")
    finally:
        writer.close()


def file_part(text: str) -> str:
    """``text`` as part of a file name (letters, digits, ``.``, ``_``, ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def comparison_figures(root: Path, runs: list[Run], board: Any) -> dict[str, tuple[str, Any]]:
    """``{tag: (PNG name, figure)}``: each quality metric against the KV kept
    (``quality_vs_memory/<metric>``) and each task family's score against each budget kind
    (``score_vs_<kind>/<family>``), one card each."""
    figures = {
        f"quality_vs_memory/{metric}": (f"quality_vs_memory.{file_part(metric)}.png",
                                        quality_figure(runs, metric, root.name))
        for metric in quality_metrics(runs)
    }  # fmt: skip
    for kind in sorted({b.kind for b in board.budgets} - {FULL}) if board is not None else []:
        title = f"{root.name}: task score vs KV budget"
        for family, fig in score_figures(board, kind, title).items():
            figures[f"score_vs_{kind}/{family}"] = (f"score_vs_{kind}.{file_part(family)}.png", fig)
    return figures


def runs_table(runs: list[Run], names: dict[str, str]) -> str:
    """The display names beside the run directories they stand for (Markdown)."""
    rows = [[names.get(r.method, r.method), r.method] for r in runs]
    return "\n## Runs: display names and directories\n\n" + markdown(["name", "run directory"], rows)


def write_comparison(root: Path, plots: bool = True) -> tuple[str, list[str]]:
    """Write the comparison files, and refresh the runs' HPARAMS trials and the experiment's
    HPARAMS configuration (:func:`kvlab.runner.views.write_experiment_summaries`); returns the
    Markdown and the names of the files written."""
    runs = load_runs(root)
    stale_files = [root / "leaderboard.csv", root / "positions_overlap.csv", root / "longbench_e.csv"]
    stale_plots = [*root.glob("score_vs_*.png"), *root.glob("quality_vs_memory*.png")]
    for stale in [*stale_plots, *stale_files]:
        stale.unlink(missing_ok=True)  # our own outputs of an earlier compare
    shutil.rmtree(root / TB_DIR, ignore_errors=True)  # its TEXT and figures, even under --no-plots
    names = display_names([(r.method, r.fields) for r in runs])
    outputs: dict[str, str] = {}
    keys = columns(runs)
    text = shown_table(runs, keys, names)
    outputs["compare.csv"] = csv_text(["method", *keys], table(runs, keys))
    board = leaderboard(runs)
    if board is not None:
        section, outputs["leaderboard.csv"] = leaderboard_text(board)
        text += section
    buckets = [[names.get(r.method, r.method), task, *(_cell(v[b]) for b in LONGBENCH_E_BUCKETS)]
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
    text += runs_table(runs, names)
    outputs["compare.md"] = text
    for name, content in outputs.items():
        (root / name).write_text(content)
    written = list(outputs)
    if plots:
        figures = comparison_figures(root, runs, board)
        write_tensorboard(root / TB_DIR, text, write_figures(root, figures))
        written += [name for name, _ in figures.values()] + [str(TB_DIR)]
    write_experiment_summaries(root)
    return text, written


def compare_experiment(experiment: str | Path, plots: bool = True) -> str:
    """Write the comparison files of an experiment; returns the Markdown (table, leaderboard, overlap)."""
    return write_comparison(Path(experiment), plots)[0]
