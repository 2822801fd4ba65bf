"""The leaderboard of ``kvlab compare``: task score by method (rows) and KV budget (columns).

Per task family and overall, the table and the score-vs-budget figure KV-cache papers print
(``docs/evaluation.md``, "Comparing runs"). A run's budget comes from its ``run.json``; a
sample's task, family and metric from its ``meta`` (``task``, ``task_family``, ``metric``, set by
the benchmarks, :mod:`kvlab.data.vlm_tasks`) or else from the run's dataset.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.data import DATASETS
from kvlab.metrics.tasks import TASK_METRICS
from kvlab.runner.marked_cells import CellScores, interval_kinds, legend, marked_rows
from kvlab.runner.runs import Run

FULL = "full"  # the budget label of a run that compresses nothing
OVERALL = "overall"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def csv_text(header: list[str], rows: list[list[str]]) -> str:
    """A CSV table."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *rows])
    return out.getvalue()


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # matplotlib: imported when a figure is drawn (a dependency; slow to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class BudgetPoint:
    """A run's budget: ``kind`` ``ratio`` (kept fraction of each prompt) or ``tokens`` (per KV
    head), or ``full`` (no compression)."""

    kind: str
    value: float

    @property
    def label(self) -> str:
        return FULL if self.kind == FULL else f"{self.kind}={self.value:g}"


def budget_point(fields: dict[str, Any]) -> BudgetPoint:
    """The budget in a run's fingerprint fields (``model.compression.budget``: ``{ratio: r}``,
    ``{tokens: n}`` or their shorthands ``0.2`` / ``128``); ``full`` without scorers or budget."""
    compression = (fields.get("model") or {}).get("compression") or {}
    scored = any(compression.get(slot) for slot in ("importance", "diversity", "route"))
    budget = compression.get("budget")
    if isinstance(budget, dict):
        budget = budget.get("ratio") if budget.get("ratio") is not None else budget.get("tokens")
    if not scored or budget is None or isinstance(budget, bool):
        return BudgetPoint(FULL, 1.0)
    return BudgetPoint("tokens" if isinstance(budget, int) else "ratio", float(budget))


#: the ``model.compression`` steps that change the kept entries without evicting any (a pipeline of
#: them alone has no budget, yet is not the full cache)
ENTRY_STEPS = ("quantize", "channels")


def keeps_full_cache(fields: dict[str, Any]) -> bool:
    """Whether a run keeps the full cache (no budget, and nothing quantized or channel-pruned): the
    reference the other rows are marked against. A run that only quantizes has no budget either
    (its score fills every column) but is not the full cache."""
    compression = (fields.get("model") or {}).get("compression") or {}
    changes = any(compression.get(slot) for slot in ENTRY_STEPS)
    return budget_point(fields).kind == FULL and not changes


#: sweep keys that set the budget size (the leaderboard's columns); ``budget.window`` etc. stay in the name
BUDGET_KEYS = ("budget", "budget.ratio", "budget.tokens")


def method_label(run: Run) -> str:
    """The run's name without its budget-size sweep keys (``snapkv@budget.ratio=0.1`` -> ``snapkv``;
    ``budget.window`` and the other budget fields stay: they make another method)."""
    rest = {k: v for k, v in run.point.items() if k not in BUDGET_KEYS}
    return run.family + ("@" + ",".join(f"{k}={v}" for k, v in rest.items()) if rest else "")


def method_key(run: Run) -> str:
    """What makes two runs the same method at different budgets: the family (the run's name before
    ``@``) and the recorded ``model`` fields (model, compression, protocol, ...) without the
    budget's size (``compression.budget`` ``ratio`` / ``tokens``, or its shorthand); the data may
    differ (a benchmark's tasks run one by one). Without a ``run.json``: :func:`method_label`."""
    model = (run.fields.get("model") or {}) if run.fields else {}
    if not model:
        return method_label(run)
    compression = dict(model.get("compression") or {})
    budget = compression.pop("budget", None)
    if isinstance(budget, dict):  # window, sinks, max_window_share stay part of the method
        compression["budget"] = {k: v for k, v in budget.items() if k not in ("ratio", "tokens")}
    return json.dumps([run.family, {**model, "compression": compression}], sort_keys=True)


def primary_metric(run: Run) -> str | None:
    """The task metric a run's dataset names first (``data.dataset.metrics`` in ``run.json``, else the
    dataset class's default); None when its records hold no task score."""
    dataset = (run.fields.get("data") or {}).get("dataset") or {}
    names = dataset.get("metrics") if isinstance(dataset, dict) else None
    if not names and isinstance(dataset, dict) and dataset.get("name") in DATASETS:
        cls = DATASETS.get(dataset["name"])
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        names = {f.name: f.default for f in fields}.get("metrics")
    # the dataset's metric when it names one (None if its records lack it: never another metric)
    names = [n for n in (names or []) if n in TASK_METRICS] or list(TASK_METRICS)
    return next((n for n in names if any(n in r for r in run.records)), None)


@dataclass
class Leaderboard:
    """``scores[family][method][budget label]`` in %, the budgets in column order, the task metrics
    used per family, the methods without a budget (``full``: their score fills every column), of
    them those that keep the full cache (``reference``: what the marks compare with, drawn dashed;
    a run that only quantizes is in ``full`` alone), and ``samples[method][budget label]``: each
    cell's per-sample scores (every family's; the budget-free runs' under :data:`FULL`), for the
    intervals and resolved marks (:func:`cell_samples`)."""

    scores: dict[str, dict[str, dict[str, float]]]
    budgets: list[BudgetPoint]
    metrics: dict[str, list[str]]
    full: set[str]
    reference: set[str]
    samples: dict[str, dict[str, CellScores]] = field(default_factory=dict)


def cell_samples(board: Leaderboard, family: str, method: str, label: str) -> CellScores | None:
    """The per-sample scores behind ``board.scores[family][method][label]`` (every family's for
    ``overall``); None where the cell is empty."""
    if label not in board.scores.get(family, {}).get(method, {}):
        return None
    by_label = board.samples.get(method, {})
    scores = by_label.get(FULL if method in board.full else label) or by_label.get(label)
    if not scores:
        return None
    return scores if family == OVERALL else {k: v for k, v in scores.items() if k[0] == family}


def _labels(runs: list[Run]) -> dict[str, str]:
    """Method key -> row label: the family (``snapkv``), or the name without its budget keys where two
    methods share a family."""
    families_of: dict[str, set[str]] = {}
    for run in runs:
        families_of.setdefault(run.family, set()).add(method_key(run))
    labels = {method_key(r): r.family if len(families_of[r.family]) == 1 else method_label(r) for r in runs}
    keys_of: dict[str, list[str]] = {}
    for key, label in labels.items():
        keys_of.setdefault(label, []).append(key)
    for label, keys in keys_of.items():  # two methods, one name (e.g. another protocol): never merged
        if len(keys) > 1:
            for key in keys:
                labels[key] = f"{label}#{hashlib.sha256(key.encode()).hexdigest()[:6]}"
    return labels


def leaderboard(runs: list[Run]) -> Leaderboard | None:
    """Per (method, budget): each sample's task score, averaged per task, the tasks of a family
    averaged (macro), and ``overall`` = the mean over families (with two families or more, and only
    where every family has a score). A sample's task is ``meta.task`` (else the run's dataset name),
    its family ``meta.task_family`` (else its task), its metric ``meta.metric`` (else the run's
    :func:`primary_metric`). Runs of one method (:func:`method_key`) and budget are pooled. The full
    cache (no budget) fills every budget column. None when no run has task scores."""
    pooled: dict[tuple[str, BudgetPoint], dict[str, dict[str, list[float]]]] = {}
    samples: dict[str, dict[str, CellScores]] = {}
    metrics: dict[str, list[str]] = {}
    labels = _labels(runs)
    reference = {labels[method_key(run)] for run in runs if keeps_full_cache(run.fields)}
    for run in runs:
        default_metric = primary_metric(run)
        dataset = (run.fields.get("data") or {}).get("dataset") or {}
        default_task = str(dataset.get("name", "task")) if isinstance(dataset, dict) else "task"
        for record in run.records:
            meta = record.get("meta") or {}
            metric = meta.get("metric") if meta.get("metric") in TASK_METRICS else default_metric
            if metric is None or record.get(metric) is None:
                continue
            task = str(meta.get("task") or default_task)
            family = str(meta.get("task_family") or task)
            method, budget = labels[method_key(run)], budget_point(run.fields)
            cell = pooled.setdefault((method, budget), {})
            cell.setdefault(family, {}).setdefault(task, []).append(100.0 * float(record[metric]))
            by_label = samples.setdefault(method, {}).setdefault(budget.label, {})
            stratum = by_label.setdefault((family, task), {})
            key = str(record.get("id"))
            while key in stratum:  # pooled runs that hold the same id: each record counts, as above
                key += "+"
            stratum[key] = float(record[metric])
            if metric not in metrics.setdefault(family, []):
                metrics[family].append(metric)
    if not pooled:
        return None
    budgets = sorted({b for _, b in pooled if b.kind != FULL}, key=lambda b: (b.kind, b.value))
    budgets = budgets or [BudgetPoint(FULL, 1.0)]
    scores: dict[str, dict[str, dict[str, float]]] = {}
    names = sorted(metrics)
    full = {method for method, budget in pooled if budget.kind == FULL}
    for (method, budget), by_family in pooled.items():
        family_scores = {
            family: sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)
            for family, tasks in by_family.items()
        }
        if len(names) > 1 and set(family_scores) == set(names):  # one family: overall would repeat it
            family_scores[OVERALL] = sum(family_scores.values()) / len(family_scores)
        for family, value in family_scores.items():
            row = scores.setdefault(family, {}).setdefault(method, {})
            for label in [b.label for b in budgets] if budget.kind == FULL else [budget.label]:
                row[label] = value
    return Leaderboard(scores, budgets, metrics, full, reference & full, samples)


def family_order(board: Leaderboard) -> list[str]:
    return ([OVERALL] if OVERALL in board.scores else []) + sorted(f for f in board.scores if f != OVERALL)


def family_methods(board: Leaderboard, family: str) -> list[str]:
    """The full cache first, then the other runs without a budget (quantized only), then the
    methods by name."""
    rows = board.scores[family]
    return sorted(rows, key=lambda m: (m not in board.reference, m not in board.full, m))


def family_columns(board: Leaderboard, family: str, methods: list[str]) -> list[dict[str, CellScores]]:
    """Per budget of the board, ``{method: its cell's per-sample scores}`` in ``family``."""
    columns = []
    for budget in board.budgets:
        cells = {m: cell_samples(board, family, m, budget.label) for m in methods}
        columns.append({m: c for m, c in cells.items() if c})
    return columns


def leaderboard_text(board: Leaderboard) -> tuple[str, str]:
    """The leaderboard as Markdown sections, each cell with its 95% interval and resolved marks
    (:mod:`kvlab.runner.marked_cells`, the legend under the tables), and as CSV (``family, method,
    <budget>...``, in %, the scores alone)."""
    labels = [b.label for b in board.budgets]
    parts = ["\n## Leaderboard: task score (%) by method and budget\n"]
    rows_csv = []
    kinds: set[str] = set()
    for family in family_order(board):
        used = ", ".join(sorted({m for f, ms in board.metrics.items() for m in ms if family in (f, OVERALL)}))
        title = "overall (mean of the task families)" if family == OVERALL else family
        parts.append(f"\n### {title} ({used})\n\n")
        methods = family_methods(board, family)
        columns = family_columns(board, family, methods)
        kinds |= interval_kinds(c for column in columns for c in column.values())
        rows = [
            [c if c != "-" else "" for c in row] for row in marked_rows(methods, columns, board.reference)
        ]
        for method in methods:
            values = board.scores[family][method]
            rows_csv.append(
                [family, method, *(f"{values[label]:.3f}" if label in values else "" for label in labels)]
            )
        parts.append(markdown(["method", *labels], rows))
    parts.append("\n" + legend(kinds or {"wilson"}))
    return "".join(parts), csv_text(["family", "method", *labels], rows_csv)


def legend_entries(axes: Any) -> tuple[list[Any], list[str]]:
    """``(handles, labels)`` of every panel's lines, each label once: a method drawn only in some
    panels (a family it has no score in elsewhere) is named too."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    return list(entries.values()), list(entries)


#: markers cycled independently of the ten colours, so two methods never share colour and marker
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")


def line_styles(methods: list[str]) -> dict[str, dict[str, Any]]:
    """One distinct look per method, the same in every panel and card: a colour of ten, a marker of
    :data:`MARKERS` (the two cycle out of step: 19 VLM presets stay unambiguous), solid lines for
    the first ten methods, then dashed, then dotted."""
    linestyles = ("-", "--", ":")
    styles: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method not in styles:
            i = len(styles)
            styles[method] = {
                "color": f"C{i % 10}",
                "marker": MARKERS[i % len(MARKERS)],
                "linestyle": linestyles[(i // 10) % len(linestyles)],
                "markersize": 7,
            }
    return styles


def dodge(
    series: dict[str, list[tuple[float, float]]], log: bool = False, share: float = 0.015
) -> tuple[dict[str, list[tuple[float, float]]], bool]:
    """Points of several methods that coincide (same x, same y to 6 digits) moved side by side in x,
    in the order of ``series``, by ``share`` of the x range per method (a factor on a log axis), so
    every method stays visible where lines lie on top of each other. Returns the series and whether
    any point moved; the y values are never changed."""
    xs = [x for points in series.values() for x, _ in points]
    if not xs:
        return series, False
    if log:
        span = math.log(max(xs) / min(xs)) if min(xs) > 0 else 0.0
        step = share * (span or 1.0)
    else:
        span = max(xs) - min(xs)
        step = share * (span or abs(xs[0]) or 1.0)
    groups: dict[tuple[float, float], list[str]] = {}
    for method, points in series.items():
        for x, y in points:
            groups.setdefault((x, round(y, 6)), []).append(method)
    moved = False
    out: dict[str, list[tuple[float, float]]] = {}
    for method, points in series.items():
        shifted = []
        for x, y in points:
            group = groups[(x, round(y, 6))]
            offset = (group.index(method) - (len(group) - 1) / 2) * step
            moved = moved or offset != 0
            shifted.append((x * math.exp(offset) if log else x + offset, y))
        out[method] = shifted
    return out, moved


def plot_series(
    ax: Any,
    series: dict[str, list[tuple[float, float]]],
    styles: dict[str, dict[str, Any]],
    log: bool = False,
) -> bool:
    """A line per method of ``series`` (``{method: [(x, y)]}``) in its :func:`line_styles` look, so
    that every method stays visible: coinciding points side by side (:func:`dodge`) and, where
    some moved, each line a little thinner than the one drawn before it (a later line never
    covers an earlier one). Returns whether points were moved aside."""
    drawn, moved = dodge({method: points for method, points in series.items() if points}, log=log)
    for i, (method, points) in enumerate(drawn.items()):
        width = max(1.2, 5.0 - 1.8 * i) if moved else 1.8
        ax.plot(*zip(*points, strict=True), label=method, linewidth=width, **styles[method])
    return moved


def draw_scores(
    ax: Any, board: Leaderboard, family: str, kind: str, styles: dict[str, dict[str, Any]]
) -> bool:
    """One family's scores (%) against the budgets of ``kind`` on ``ax``: a line per method
    (:func:`plot_series`), the full cache as a dashed black line. Returns whether points were
    moved aside."""
    points = [b for b in board.budgets if b.kind == kind]
    series: dict[str, list[tuple[float, float]]] = {}
    for method in family_methods(board, family):
        values = board.scores[family][method]
        if method in board.reference:
            level = next(iter(values.values()))
            ax.axhline(level, color="black", linestyle="--", linewidth=1.4, label=method)
        else:  # a budget-free run that is not the full cache (quantized only) is a flat line
            series[method] = [(b.value, values[b.label]) for b in points if b.label in values]
    moved = plot_series(ax, series, styles, log=kind == "tokens")
    ratio = kind == "ratio"
    ax.set_xlabel("budget.ratio (kept share of each prompt)" if ratio else "budget.tokens per KV head")
    ax.set_ylabel("score (%)")
    if kind == "tokens":
        ax.set_xscale("log", base=2)
    ax.set_xticks([b.value for b in points], [f"{b.value:g}" for b in points])
    ax.minorticks_off()
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    return moved


def family_metrics(board: Leaderboard, family: str) -> str:
    """The task metrics behind a family's scores (every family's for ``overall``)."""
    return ", ".join(board.metrics.get(family, [])) or ", ".join(
        sorted({m for v in board.metrics.values() for m in v})
    )


def plot_leaderboard(board: Leaderboard, kind: str, path: Path, title: str) -> Any:
    """Score (%) against budget of one kind (``ratio`` or ``tokens``) in one file: a panel per
    family (overall first), a line per method, the full cache as a dashed line; saved as PNG
    (>= 600 px wide). The reference tables' figure; ``kvlab compare`` writes one card per family
    instead (:func:`kvlab.runner.compare.score_figures`)."""
    plt = pyplot()
    order = family_order(board)
    cols = min(3, len(order))
    rows = math.ceil(len(order) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1.2, 3.6 * rows), squeeze=False)
    styles = line_styles(
        [m for family in order for m in family_methods(board, family) if m not in board.reference]
    )
    for ax, family in zip(axes.flat, order, strict=False):
        draw_scores(ax, board, family, kind, styles)
        name = "overall (mean of families)" if family == OVERALL else family
        ax.set_title(f"{name} - {family_metrics(board, family)}", fontsize=10)
    for ax in list(axes.flat)[len(order) :]:
        ax.set_visible(False)
    handles, labels = legend_entries(axes.flat)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig
