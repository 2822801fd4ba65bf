"""The reference tables: methods x budgets on the synthetic tasks, and the RULER-style suite.

What ``kvlab reference-table`` (:mod:`kvlab.cli.reference_table`) runs and prints: the resolved
``kvlab predict`` config of each table cell (:func:`run_config`, :func:`suite_config`), the run
directories (``<dir>/<task>/<method>@budget=<ratio>/``, ``full`` once as ``full/``; with
``--suite ruler`` one experiment per protocol, ``<dir>/ruler-<protocol>/...``; ``--suite vlm``
``<dir>/vlm-<protocol>/...``, :mod:`kvlab.runner.reference_vlm`), and the Markdown
tables read back from the runs (:func:`table`: one row per method, one column per ``task @
budget``; :func:`suite_table`: the score by protocol and budget, by task and by length, from the
leaderboard of ``kvlab compare``) and the suite's score-vs-budget figure (:func:`plot_suite`).
:func:`replace_section` writes a table between its markers in ``docs/evaluation.md``.
Every cell carries its 95% interval and each column marks the resolved differences
(:mod:`kvlab.runner.marked_cells`, from the runs' per-sample records).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.loader import load_config
from kvlab.runner.compare import compare_experiment
from kvlab.runner.leaderboard import (
    OVERALL,
    BudgetPoint,
    Leaderboard,
    cell_samples,
    leaderboard,
    markdown,
    plot_leaderboard,
    pyplot,
)
from kvlab.runner.marked_cells import CellScores, interval_kinds, legend, marked_rows
from kvlab.runner.runs import load_runs
from kvlab.runner.writer import PREDICTIONS, read_predictions

MODEL = "smollm2-135m"
METHODS = (
    "full",
    "random",
    "streamingllm",
    "knorm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "adakv",
    "mixkv_snapkv",
    "mixkv_adakv",
    "retrieval",
    "hybridkv",
)
BUDGETS = (0.1, 0.25)
#: the reference tasks: name -> dataset node (num_samples is set by --samples)
TASKS: dict[str, dict[str, Any]] = {
    f"retrieval-{name}": {"name": "synthetic_retrieval", "context_tokens": tokens, "num_pairs": 1, "seed": 0}
    for name, tokens in (("512", 512), ("1k", 1024), ("2k", 2048), ("4k", 4096))
}
DEFAULT_TASKS = ("retrieval-1k",)
MARK_START, MARK_END = "<!-- reference-table:start -->", "<!-- reference-table:end -->"

#: ``--suite ruler``: the methods, budgets, protocols, RULER tasks and lengths run by default
SUITE_METHODS = (
    "full",
    "streamingllm",
    "snapkv",
    "pyramidkv",
    "adakv",
    "keydiff",
    "mixkv_snapkv",
    "mixkv_adakv",
)
SUITE_BUDGETS = (0.1, 0.25, 0.5)
SUITE_PROTOCOLS = ("query_aware", "query_agnostic")
SUITE_TASKS = ("niah_single_2", "niah_multikey_1")
SUITE_LENGTHS = (1024, 2048, 4096)
SUITE_METRIC = "string_match_all"
SUITE_START, SUITE_END = "<!-- reference-suite:start -->", "<!-- reference-suite:end -->"
VLM_MARKS = ("<!-- reference-vlm:start -->", "<!-- reference-vlm:end -->")


def run_config(
    method: str,
    ratio: float | None,
    task: dict[str, Any],
    run: dict[str, str],
    model_name: str = MODEL,
    quantize: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The resolved ``kvlab predict`` config of one table cell (``ratio`` None: the preset's budget;
    ``quantize``: the cell's ``model.compression.quantize``, :data:`kvlab.runner.reference_pareto.
    FORMATS`)."""
    cfg = load_config(method)
    model = cfg.setdefault("model", {})
    model.update(model=model_name, fidelity=False)
    compression = model.get("compression") or {}
    if ratio is not None and compression:
        budget = compression.get("budget", {})
        budget = dict(budget) if isinstance(budget, dict) else {}
        budget.pop("tokens", None)
        compression["budget"] = {**budget, "ratio": ratio}
    if quantize is not None:
        model["compression"] = {**compression, "quantize": dict(quantize)}
    cfg.setdefault("data", {})["dataset"] = dict(task)
    cfg["run"] = dict(run)
    return cfg


def run_name(method: str, ratio: float | None, storage: str = "none") -> str:
    """Directory name of a run: ``snapkv@budget=0.1`` (the sweep convention), ``full`` for the full
    cache; a storage format other than ``none`` adds ``quantize=<format>``: ``snapkv@budget=0.1,
    quantize=kivi2``, ``full@quantize=int8``."""
    point = ([] if ratio is None else [f"budget={ratio:g}"]) + (
        [] if storage == "none" else [f"quantize={storage}"]
    )
    return f"{method}@{','.join(point)}" if point else method


def cells(methods: tuple[str, ...], budgets: tuple[float, ...]) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs to run; the full cache runs once (no budget)."""
    return [(m, None) for m in methods if m == "full"] + [
        (m, r) for m in methods if m != "full" for r in budgets
    ]


def run_scores(run_dir: Path, metric: str, stratum: tuple[str, str]) -> CellScores:
    """A run's per-sample ``metric`` from its ``predictions.jsonl``, keyed by sample id, as one
    stratum's cell (empty when the run or the metric is missing)."""
    scores = {
        str(r["id"]): float(r[metric])
        for r in _records(run_dir)
        if isinstance(r.get(metric), int | float) and not isinstance(r.get(metric), bool)
    }
    return {stratum: scores} if scores else {}


def table(
    root: Path, tasks: list[str], methods: tuple[str, ...], budgets: tuple[float, ...], metric: str
) -> str:
    """Markdown table of ``metric`` (%): one row per method, one column per task and budget, each
    cell with its 95% interval and the column's resolved marks (:mod:`kvlab.runner.marked_cells`),
    from the runs' per-sample records; the legend below."""
    header = ["method"] + [f"{task} @ {r:.0%}" for task in tasks for r in budgets]
    columns = [
        {m: run_scores(root / task / run_name(m, None if m == "full" else r), metric, (task, task))
         for m in methods}
        for task in tasks for r in budgets
    ]  # fmt: skip
    kinds = interval_kinds(c for column in columns for c in column.values())
    return markdown(header, marked_rows(methods, columns, ["full"])) + "\n" + legend(kinds or {"wilson"})


def replace_section(doc: Path, text: str, start: str = MARK_START, end: str = MARK_END) -> None:
    """Replace what lies between the markers ``start`` and ``end`` of ``doc`` with ``text``."""
    content = doc.read_text()
    if start not in content or end not in content:
        raise ConfigError(
            f"--docs {doc}: the file lacks the markers {start} and {end} around the table; "
            f"add them where the table goes."
        )
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{text}{end}{tail}")


# ---- --suite ruler ------------------------------------------------------------------------------
def suite_config(
    method: str,
    ratio: float | None,
    protocol: str,
    dataset: dict[str, Any],
    run: dict[str, str],
    model_name: str = MODEL,
) -> dict[str, Any]:
    """The resolved ``kvlab predict`` config of one suite cell: :func:`run_config` under
    ``model.protocol: protocol``. The engine check against transformers (``model.verify``) runs in
    the ``full`` run only: it compares the full cache, the same for every method."""
    cfg = run_config(method, ratio, dataset, run, model_name)
    cfg["model"].update(protocol=protocol, verify="first_batch" if method == "full" else "off")
    return cfg


def suite_experiment(protocol: str, suite: str = "ruler") -> str:
    """The experiment directory of one protocol's runs: ``ruler-query_aware``, ``vlm-query_aware``."""
    return f"{suite}-{protocol}"


def _family(board: Leaderboard) -> str | None:
    """The board's family a suite cell reads: ``overall`` (the mean over the task families), or its
    only family."""
    return OVERALL if OVERALL in board.scores else next(iter(board.scores), None)


def _overall(board: Leaderboard | None, method: str, label: str) -> float | None:
    """The board's score (%) of ``method`` at budget ``label`` (:func:`_family`)."""
    family = _family(board) if board is not None else None
    return board.scores.get(family, {}).get(method, {}).get(label) if board and family else None


def _overall_samples(board: Leaderboard | None, method: str, label: str) -> CellScores | None:
    """The per-sample scores behind :func:`_overall`'s cell."""
    family = _family(board) if board is not None else None
    return cell_samples(board, family, method, label) if board and family else None


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return read_predictions(run_dir) if (run_dir / PREDICTIONS).is_file() else []


def grouped_scores(records: list[dict[str, Any]], metric: str, key: str) -> CellScores:
    """Per value ``g`` of ``meta[key]``, the stratum ``(g, g)`` of each sample's mean ``metric`` over
    its records (by id: the budgets' runs of one prompt), the unit the grouped tables' intervals
    and paired tests resample."""
    sums: dict[tuple[str, str], dict[str, list[float]]] = {}
    for record in records:
        value, group = record.get(metric), (record.get("meta") or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and group is not None:
            stratum = sums.setdefault((str(group), str(group)), {})
            stratum.setdefault(str(record.get("id")), []).append(float(value))
    return {k: {i: sum(v) / len(v) for i, v in ids.items()} for k, ids in sums.items()}


def suite_boards(
    root: Path, protocols: tuple[str, ...], plots: bool = True, suite: str = "ruler"
) -> dict[str, Leaderboard | None]:
    """Per protocol, the leaderboard of its experiment (:func:`kvlab.runner.leaderboard.leaderboard`
    over every run there); with ``plots``, ``kvlab compare`` is run on it too (its tables, per-task
    ``score_vs_ratio.<family>.png`` cards and TensorBoard views land in the experiment directory)."""
    boards: dict[str, Leaderboard | None] = {}
    for protocol in protocols:
        experiment = root / suite_experiment(protocol, suite)
        if not experiment.is_dir():
            boards[protocol] = None
            continue
        if plots:
            compare_experiment(experiment)
        boards[protocol] = leaderboard(load_runs(experiment))
    return boards


def suite_table(
    root: Path,
    protocols: tuple[str, ...],
    methods: tuple[str, ...],
    budgets: tuple[float, ...],
    metric: str = SUITE_METRIC,
    boards: dict[str, Leaderboard | None] | None = None,
    suite: str = "ruler",
    groups: tuple[tuple[str, str], ...] = (("task", "task"), ("length", "length (tokens)")),
) -> str:
    """The suite's Markdown: the score (%) of each method (rows) by protocol and budget (the mean
    over the tasks, from the leaderboard of ``kvlab compare``), then one table per ``(meta key,
    title)`` of ``groups`` (RULER: by task and by length), each averaged over the budgets (every
    budget's run scores the same samples: each prompt's mean over them, then over the prompts).
    Every cell with its 95% interval and each column's resolved marks
    (:mod:`kvlab.runner.marked_cells`; in the grouped tables a prompt is the unit resampled and
    paired), the legend under the last table."""
    boards = suite_boards(root, protocols, plots=False, suite=suite) if boards is None else boards
    full = [m for m in methods if m == "full"]
    header = ["method"] + [f"{p} @ {r:.0%}" for p in protocols for r in budgets]
    columns = [
        {m: c for m in methods if (c := _overall_samples(boards[p], m, f"ratio={r:g}"))}
        for p in protocols for r in budgets
    ]  # fmt: skip
    kinds = interval_kinds(c for column in columns for c in column.values())
    parts = [f"**Score (%) by protocol and budget** (`{metric}` x 100, mean over the tasks)\n\n"]
    parts.append(markdown(header, marked_rows(methods, columns, full)))
    for key, title in groups:
        cells: dict[tuple[str, str], CellScores] = {}
        names: list[str] = []
        for protocol in protocols:
            for method in methods:
                runs = [None] if method == "full" else list(budgets)
                records = [
                    r
                    for ratio in runs
                    for r in _records(root / suite_experiment(protocol, suite) / run_name(method, ratio))
                ]
                cells[protocol, method] = grouped_scores(records, metric, key)
                names += [g for g, _ in cells[protocol, method] if g not in names]
        names.sort(key=lambda g: (0, int(g), "") if g.isdigit() else (1, 0, g))
        header = ["method"] + [f"{p}: {g}" for p in protocols for g in names]
        columns = [
            {m: {(g, g): cells[p, m][g, g]} for m in methods if (g, g) in cells[p, m]}
            for p in protocols for g in names
        ]  # fmt: skip
        kinds |= interval_kinds(c for column in columns for c in column.values())
        parts.append(f"\n**By {title}** (mean over the budgets: each prompt's, then over the prompts)\n\n")
        parts.append(markdown(header, marked_rows(methods, columns, full)))
    parts.append("\n" + legend(kinds or {"wilson"}))
    return "".join(parts)


def plot_suite(
    boards: dict[str, Leaderboard | None], methods: tuple[str, ...], path: Path, title: str
) -> Path | None:
    """Score (%) against the budget ratio, one panel per protocol (each its leaderboard's overall
    score), one line per method, the full cache dashed: :func:`~kvlab.runner.leaderboard.
    plot_leaderboard` on a board whose families are the protocols. None when nothing was scored."""
    scores: dict[str, dict[str, dict[str, float]]] = {}
    metrics: dict[str, list[str]] = {}
    points: set[BudgetPoint] = set()
    full: set[str] = set()
    reference: set[str] = set()
    for protocol, board in boards.items():
        if board is None:
            continue
        row = {}
        for method in methods:
            values = {
                b.label: v for b in board.budgets if (v := _overall(board, method, b.label)) is not None
            }
            if values:
                row[method] = values
        if row:
            scores[protocol] = row
            metrics[protocol] = sorted({m for ms in board.metrics.values() for m in ms})
            points |= {b for b in board.budgets if b.kind == "ratio"}
            full |= board.full
            reference |= board.reference
    if not scores or not points:
        return None
    merged = Leaderboard(scores, sorted(points, key=lambda b: b.value), metrics, full, reference)
    fig = plot_leaderboard(merged, "ratio", path, title)
    pyplot().close(fig)
    return path
