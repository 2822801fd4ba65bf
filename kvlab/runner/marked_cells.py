"""A results table's cells with their 95% intervals and resolved marks.

The leaderboard of ``kvlab compare`` and the reference tables print a score (%) per method (row)
and budget (column). Each cell here is the per-sample scores behind it (:data:`CellScores`,
samples keyed by id within their ``(family, task)`` stratum), its value the leaderboard's macro
mean (each task's mean, a family's tasks averaged, the families averaged: :func:`strata`), its
interval :func:`kvlab.metrics.intervals.cell_interval`'s (Wilson for a share of 0/1 scores, a
stratified percentile bootstrap otherwise). In each column (:func:`column_marks`) the top
compressed method is in **bold**, and a cell is marked where a paired test on the samples both
cells share resolves its difference (:func:`kvlab.metrics.intervals.resolved`): ``*`` from the
full cache, ``†`` below the bold cell. :func:`legend` says so under the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvlab.metrics.intervals import (
    RESAMPLES,
    SEED,
    Interval,
    cell_interval,
    resolved,
    samples_for_half_width,
    weighted_mean,
    wilson,
)

#: a cell's per-sample scores in [0, 1]: ``{(family, task): {sample id: score}}``
CellScores = dict[tuple[str, str], dict[str, float]]

FULL_MARK, BEST_MARK = "*", "†"


def strata(
    scores: CellScores, keys: Iterable[tuple[str, str]] | None = None
) -> tuple[list[tuple[str, str]], list[float]]:
    """The cell's non-empty strata (``keys``: only these) in order, and their weights: the
    leaderboard's macro mean, ``1 / (families x the family's tasks)`` each."""
    chosen = sorted(k for k in (scores if keys is None else keys) if scores.get(k))
    tasks: dict[str, int] = {}
    for family, _ in chosen:
        tasks[family] = tasks.get(family, 0) + 1
    return chosen, [1.0 / (len(tasks) * tasks[family]) for family, _ in chosen]


def value(scores: CellScores) -> float | None:
    """The cell's score in [0, 1] (None without samples)."""
    keys, weights = strata(scores)
    return weighted_mean([list(scores[k].values()) for k in keys], weights) if keys else None


def interval(scores: CellScores) -> Interval | None:
    """The cell's 95% interval in [0, 1] (None without samples)."""
    keys, weights = strata(scores)
    return cell_interval([list(scores[k].values()) for k in keys], weights) if keys else None


def differs(a: CellScores, b: CellScores) -> bool:
    """Whether two cells differ resolvably at 95%, paired on the samples both hold (the same id in
    the same stratum; the strata weighted as the leaderboard weighs them); False without any."""
    shared = {k: sorted(set(a[k]) & set(b[k])) for k in set(a) & set(b)}
    keys, weights = strata({k: dict.fromkeys(ids, 0.0) for k, ids in shared.items()})
    if not keys:
        return False
    groups_a = [[a[k][i] for i in shared[k]] for k in keys]
    groups_b = [[b[k][i] for i in shared[k]] for k in keys]
    return resolved(groups_a, groups_b, weights)


def column_marks(column: dict[str, CellScores], full: Iterable[str]) -> dict[str, tuple[bool, str]]:
    """Per method of a column (in row order), ``(bold, marks)``: bold for the top compressed method
    (the first in row order among ties; none where one compressed method is alone), marks ``*``
    where the difference from the full cache (the first of ``full`` in the column) is resolved and
    ``†`` where the cell is resolved below the bold one. Methods without samples are left out."""
    scored = {m: s for m, s in column.items() if value(s) is not None}
    full = [m for m in scored if m in set(full)]
    compressed = [m for m in scored if m not in full]
    # max keeps the first of ties; one compressed method alone is no ranking
    best = max(compressed, key=lambda m: value(scored[m])) if len(compressed) > 1 else None
    out = {}
    for method, scores in scored.items():
        marks = ""
        if full and method not in full and differs(scores, scored[full[0]]):
            marks += FULL_MARK
        if best is not None and method in compressed and method != best and differs(scores, scored[best]):
            marks += BEST_MARK
        out[method] = (method == best, marks)
    return out


def cell_text(scores: CellScores | None, bold: bool = False, marks: str = "") -> str:
    """``62.5 [41, 80]*``: the score (%) to one decimal, its 95% interval in whole points, the marks;
    the score in bold for the column's top method; ``-`` without samples."""
    point, bounds = (value(scores), interval(scores)) if scores else (None, None)
    if point is None or bounds is None:
        return "-"
    number = f"{100 * point:.1f}"
    return f"{f'**{number}**' if bold else number} [{100 * bounds.low:.0f}, {100 * bounds.high:.0f}]{marks}"


def marked_rows(
    methods: Sequence[str], columns: Sequence[dict[str, CellScores]], full: Iterable[str]
) -> list[list[str]]:
    """Table rows ``[method, cell...]``: each column's cells (``{method: scores}``) with their
    intervals and :func:`column_marks`."""
    full = list(full)
    marked = [column_marks({m: c[m] for m in methods if m in c}, full) for c in columns]
    pairs = list(zip(columns, marked, strict=True))
    return [
        [method, *(cell_text(c.get(method), *m.get(method, (False, ""))) for c, m in pairs)]
        for method in methods
    ]


def legend(kinds: Iterable[str] = ("wilson", "bootstrap"), marks: bool = True) -> str:
    """The sentence under a table of :func:`cell_text` cells: what the interval is and what the marks
    mean (``kinds``: the intervals the table holds)."""
    kinds = set(kinds)
    how = []
    if "wilson" in kinds:
        how.append("the Wilson score interval where the cell is a share of 0/1 scores")
    if "bootstrap" in kinds:
        how.append(
            f"a percentile bootstrap ({RESAMPLES} resamples, seed {SEED}, within each task) where the "
            "scores are fractional or the cell is a mean over tasks of unequal sizes"
        )
    text = f"Each cell: the score (%) and its 95% interval [low, high] in points ({'; '.join(how)})."
    if marks:
        text += (
            f" In each column, **bold**: the top compressed method; `{FULL_MARK}`: the difference from "
            f"the full cache is resolved; `{BEST_MARK}`: resolved below the bold cell. Resolved: a "
            "paired test on the samples both cells hold is significant at 5% (McNemar's exact test "
            "for 0/1 scores, else a paired sign-flip test of the mean difference), each comparison "
            "on its own (no correction for the many in a table); an "
            "unmarked cell is not told apart from the full cache or the bold cell."
        )
    return text + "\n"


def interval_kinds(cells: Iterable[CellScores | None]) -> set[str]:
    """The interval kinds among ``cells`` (for :func:`legend`)."""
    return {i.kind for c in cells if c and (i := interval(c)) is not None}


def half_width_text(n: int) -> str:
    """What ``n`` samples per cell resolve: ``a cell near 50% has a 95% interval of ±20 points
    (Wilson; ±5 needs 385 samples)`` for 20 (the Wilson interval of ``n // 2`` of ``n``)."""
    low, high = wilson(n // 2, n)
    return (
        f"a cell near 50% has a 95% interval of ±{100 * (high - low) / 2:.0f} points (Wilson; ±5 "
        f"needs {samples_for_half_width(0.05)} samples)"
    )
