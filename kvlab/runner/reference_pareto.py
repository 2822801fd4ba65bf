"""Bytes against accuracy: ``kvlab reference-table --formats``, methods x storage formats x budgets.

Every (method, format, budget) cell is one ``kvlab predict`` run of the method's preset at the
budget with ``model.compression.quantize`` set to the format's quantizer (:data:`FORMATS`; ``none``
runs no quantize step: the kept entries stay in the model's dtype), under
``<dir>/<task>/<method>@budget=<ratio>,quantize=<format>/`` (:func:`kvlab.runner.reference_table.
run_name`; ``none`` keeps the plain table's names, so its runs are the plain table's). Per task,
:func:`pareto_table` prints every cell's score with its 95% interval, its mean kept KV bytes per
sample and their share of the full cache, and marks the cells on the Pareto front of bytes
against score (:func:`pareto_front`); :func:`plot_pareto` draws score against kept bytes (log x),
one colour per method, one marker per format (coinciding points side by side), the front as a
step line. ``--docs`` replaces the
block between the ``<!-- reference-pareto -->`` markers::

    kvlab reference-table --methods full,snapkv,mixkv_snapkv,keydiff,retrieval \\
        --formats none,int8,int4,kivi2,turbo3 --samples 20 \\
        --docs docs/evaluation.md --figure docs/figures/reference_pareto.png

Bytes are ``kv_bytes_kept`` (the kept prompt entries at their stored size: codes, scales, zero
points, the full-precision residual; ``docs/methods/quantization.md``, "Storage"), except for a
pipeline that retrieves (``kv_bytes_device`` recorded): there the accelerator-resident bytes
(kept entries, chunk index, fetch buffer), its whole K/V being held in host memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.runner.leaderboard import MARKERS, dodge, markdown, pyplot
from kvlab.runner.marked_cells import CellScores, cell_text, differs, interval, interval_kinds, legend, value
from kvlab.runner.reference_table import run_name
from kvlab.runner.writer import PREDICTIONS, read_predictions

#: storage format name -> ``model.compression.quantize`` (None: no quantize step)
FORMATS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "int8": {"name": "per_token", "bits": 8},
    "int4": {"name": "per_token", "bits": 4},
    "kivi2": {"name": "kivi", "bits": 2, "group": 32, "residual": 128},
    "turbo3": {"name": "turboquant", "bits": 3},
    "turbo3mse": {"name": "turboquant", "bits": 3, "keys": "mse"},
}
PARETO_START, PARETO_END = "<!-- reference-pareto:start -->", "<!-- reference-pareto:end -->"
FRONT_MARK = "front"


def parse_formats(text: str) -> tuple[str, ...]:
    """``--formats none,int8,kivi2`` -> the format names, in order; refuses an empty list, an
    unknown name or a name given twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FORMATS]
    twice = sorted({n for n in names if names.count(n) > 1})
    if unknown or twice or not names:
        problem = (
            f"unknown {', '.join(map(repr, unknown))}" if unknown
            else f"{', '.join(map(repr, twice))} given twice" if twice
            else "no name"
        )  # fmt: skip
        raise ConfigError(
            f"--formats must name storage formats from {', '.join(FORMATS)} (comma-separated, each once), "
            f"got {text!r}: {problem}. `none` is no quantize step; the others are the quantizers of "
            "docs/methods/quantization.md."
        )
    return names


@dataclass(frozen=True)
class Cell:
    """One run of the crossing: its method, budget ratio (None: the full cache) and storage format."""

    method: str
    ratio: float | None
    format: str

    @property
    def name(self) -> str:
        """The run's directory name (:func:`kvlab.runner.reference_table.run_name`)."""
        return run_name(self.method, self.ratio, self.format)


#: the cell every other is compared with: the full cache, no quantize step
REFERENCE = Cell("full", None, "none")


def crossing(cells: Sequence[tuple[str, float | None]], formats: Sequence[str]) -> list[Cell]:
    """Every (method, ratio) of ``cells`` under every format, a method's formats one after the other."""
    return [Cell(method, ratio, fmt) for method, ratio in cells for fmt in formats]


@dataclass(frozen=True)
class CellResult:
    """A run's per-sample scores and its mean bytes per sample: kept (or device-resident) and the
    full cache's."""

    scores: CellScores
    kept_bytes: float
    full_bytes: float


def cell_result(run_dir: Path, metric: str, stratum: tuple[str, str]) -> CellResult | None:
    """The run's :class:`CellResult` from its ``predictions.jsonl`` (None without a scored record)."""
    records = read_predictions(run_dir) if (run_dir / PREDICTIONS).is_file() else []
    scored = [
        r for r in records if isinstance(r.get(metric), int | float) and not isinstance(r[metric], bool)
    ]
    if not scored:
        return None
    kept = [float(r.get("kv_bytes_device", r["kv_bytes_kept"])) for r in scored]
    full = [float(r["kv_bytes_full"]) for r in scored]
    scores = {stratum: {str(r["id"]): float(r[metric]) for r in scored}}
    return CellResult(scores, sum(kept) / len(kept), sum(full) / len(full))


def pareto_front(points: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the ``(bytes, score)`` points no other point dominates: none has at most its bytes
    and at least its score with one of the two strictly better. Equal points are both on the front.
    One pass over the points sorted by bytes: a point is on the front when it has the best score of
    its bytes and beats every score at fewer bytes."""
    order = sorted(range(len(points)), key=lambda i: points[i][0])
    front: set[int] = set()
    best_before = -math.inf
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and points[order[end]][0] == points[order[start]][0]:
            end += 1
        group = order[start:end]
        top = max(points[i][1] for i in group)
        front |= {i for i in group if points[i][1] == top and top > best_before}
        best_before = max(best_before, top)
        start = end
    return front


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _budget(cell: Cell) -> str:
    return "100%" if cell.ratio is None else f"{cell.ratio:.0%}"


def pareto_table(results: dict[Cell, CellResult | None], refused: set[Cell], reference: Cell | None) -> str:
    """The Markdown table of one task: a row per cell (in the order of ``results``) with its score (%)
    and 95% interval (``*``: resolved from the ``reference`` cell, the full cache without a quantize
    step), its mean kept KV MiB per sample, their share of the full cache and ``front`` on the Pareto
    front of the cells that ran; a refused cell reads ``refused``, a cell without a run ``-``. The
    legend below."""
    ran = {c: r for c, r in results.items() if r is not None and value(r.scores) is not None}
    ranked = list(ran)
    front = {ranked[i] for i in pareto_front([(ran[c].kept_bytes, value(ran[c].scores)) for c in ranked])}
    base = ran.get(reference) if reference is not None else None
    rows = []
    for cell in results:
        row = [cell.method, cell.format, _budget(cell)]
        result = ran.get(cell)
        if result is None:
            rows.append(row + ["refused" if cell in refused else "-", "-", "-", ""])
            continue
        marks = "*" if base is not None and cell != reference and differs(result.scores, base.scores) else ""
        share = result.kept_bytes / result.full_bytes
        rows.append(
            row + [cell_text(result.scores, False, marks), _mib(result.kept_bytes), f"{share:.3f}",
                   FRONT_MARK if cell in front else ""]
        )  # fmt: skip
    header = ["method", "format", "budget", "score (%) [95%]", "kept KV MiB / sample", "x full", "Pareto"]
    kinds = interval_kinds(r.scores for r in ran.values()) or {"wilson"}
    return markdown(header, rows) + "\n" + pareto_legend(kinds)


def pareto_legend(kinds: set[str]) -> str:
    """The sentence under a :func:`pareto_table`."""
    return (
        legend(kinds, marks=False).rstrip("\n")
        + " `*`: the difference from the full cache without a quantize step is resolved (McNemar's "
        "exact test on the paired samples, else the paired sign-flip test, p < 0.05). Kept KV: the mean "
        "over samples of `kv_bytes_kept` (a retrieving pipeline: `kv_bytes_device`, the accelerator-"
        "resident bytes; its whole K/V is in host memory); `x full`: its share of the full cache in the "
        "run's dtype. `front`: on the Pareto front of the cells that ran (no other cell has at most its "
        "bytes and at least its score, one of the two strictly better), from the point scores: the "
        "intervals say how far apart they can be told.\n"
    )


def refused_text(refused: dict[tuple[str, str, str], list[Cell]]) -> str:
    """The refused cells, one entry per (method, task, reason) with its formats and budgets:
    ``retrieval as int8, int4 at 25% on retrieval-1k: <the ConfigError's first line>``."""
    entries = []
    for (method, task, reason), cells in refused.items():
        formats = ", ".join(dict.fromkeys(c.format for c in cells))
        budgets = ", ".join(dict.fromkeys(_budget(c) for c in cells))
        entries.append(f"`{method}` as {formats} at {budgets} on {task}: {reason}")
    return "; ".join(entries)


def plot_pareto(panels: dict[str, dict[Cell, CellResult | None]], path: Path, title: str) -> Path | None:
    """Score (%) against mean kept KV bytes per sample (MiB, log x), one panel per task of
    ``panels``: a colour per method, a marker per format, each point's 95% interval as a bar, the
    Pareto front (:func:`pareto_front`) as a black step line. None when nothing was scored."""
    scored = {
        task: {c: r for c, r in cells.items() if r is not None and value(r.scores) is not None}
        for task, cells in panels.items()
    }
    scored = {task: cells for task, cells in scored.items() if cells}
    if not scored:
        return None
    plt = pyplot()
    cells = [c for task in scored.values() for c in task]
    methods = list(dict.fromkeys(c.method for c in cells))
    formats = list(dict.fromkeys(c.format for c in cells))
    colours = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    markers = {f: MARKERS[i % len(MARKERS)] for i, f in enumerate(formats)}
    fig, axes = plt.subplots(1, len(scored), figsize=(6.4 * len(scored) + 1.6, 4.6), squeeze=False)
    for ax, (task, results) in zip(axes.flat, scored.items(), strict=True):
        ranked = list(results)
        points = [(results[c].kept_bytes / 2**20, 100 * value(results[c].scores)) for c in ranked]
        # coinciding points (equal bytes and score) side by side, so every marker stays visible
        shifted, _ = dodge({str(i): [p] for i, p in enumerate(points)}, log=True)
        for i, cell in enumerate(ranked):
            (x, y) = shifted[str(i)][0]
            bounds = interval(results[cell].scores)
            err = [[y - 100 * bounds.low], [100 * bounds.high - y]] if bounds is not None else None
            ax.errorbar(x, y, yerr=err, color=colours[cell.method], alpha=0.35, linewidth=1, capsize=0)
            ax.plot(x, y, linestyle="none", marker=markers[cell.format], color=colours[cell.method],
                    markersize=8, markeredgecolor="black", markeredgewidth=0.5)  # fmt: skip
        front = sorted(points[i] for i in pareto_front([(x, y) for x, y in points]))
        xs, ys = zip(*front, strict=True)
        ax.step(xs, ys, where="post", color="black", linestyle="--", linewidth=1.2)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.set_xlabel("kept KV per sample (MiB, log scale)")
        ax.set_ylabel("score (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3, which="both")
        ax.set_title(task, fontsize=10)
    handles = [plt.Line2D([], [], color=colours[m], marker="o", linestyle="none", label=m) for m in methods]
    handles += [
        plt.Line2D([], [], color="grey", marker=markers[f], linestyle="none", label=f"format: {f}")
        for f in formats
    ]
    handles.append(plt.Line2D([], [], color="black", linestyle="--", label="Pareto front"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
