"""Tests for kvlab.runner.marked_cells: a cell's value, interval and the column's resolved marks."""

from __future__ import annotations

import pytest

from kvlab.metrics import intervals
from kvlab.runner import marked_cells as cells


def test_value_is_the_leaderboards_macro_mean() -> None:
    # family f: tasks a (3 samples) and b (1); family g: task c (2) -> ((2/3 + 0) / 2 + 1/2) / 2
    scores = {
        ("f", "a"): {"1": 1.0, "2": 1.0, "3": 0.0},
        ("f", "b"): {"4": 0.0},
        ("g", "c"): {"5": 1.0, "6": 0.0},
    }
    assert cells.value(scores) == pytest.approx(((2 / 3 + 0) / 2 + 0.5) / 2)
    assert cells.strata(scores)[1] == [0.25, 0.25, 0.5]
    assert cells.interval(scores).kind == "bootstrap"  # 0/1 scores, but unequal weights: no share
    one = {("f", "a"): {"1": 1.0, "2": 0.0, "3": 1.0, "4": 1.0}}
    assert cells.interval(one) == intervals.Interval(*intervals.wilson(3, 4), "wilson")
    assert cells.value({}) is None and cells.cell_text({}) == "-" and cells.cell_text(None) == "-"


def test_differs_pairs_only_the_shared_samples() -> None:
    a = {("t", "t"): {str(i): 1.0 for i in range(8)}}
    b = {("t", "t"): {**{str(i): 0.0 for i in range(6)}, "x": 1.0, "y": 1.0}}
    assert cells.differs(a, b)  # 6 shared ids, all right only in a: p = 2/2^6
    b_fewer = {("t", "t"): {str(i): 0.0 for i in range(5)}}
    assert not cells.differs(a, b_fewer)  # 5 shared: p = 2/2^5
    assert not cells.differs(a, {("u", "u"): {"0": 0.0}})  # nothing shared


def test_column_marks_and_text() -> None:
    full = {("t", "t"): {str(i): 1.0 for i in range(20)}}
    best = {("t", "t"): {str(i): float(i < 18) for i in range(20)}}  # 18/20
    close = {("t", "t"): {str(i): float(i < 15) for i in range(20)}}  # 15/20: 3 below best, 5 below full
    far = {("t", "t"): {str(i): float(i < 8) for i in range(20)}}  # 8/20: 10 below best, 12 below full
    tie = {("t", "t"): {str(i): float(i < 18) for i in range(20)}}
    column = {"full": full, "close": close, "best": best, "tie": tie, "far": far, "none": {}}
    marks = cells.column_marks(column, ["full"])
    assert marks == {
        "full": (False, ""),
        "close": (False, ""),
        "best": (True, ""),  # the first of the two at 18/20
        "tie": (False, ""),
        "far": (False, "*†"),
    }
    rows = cells.marked_rows(["full", "best", "far", "none"], [column], ["full"])
    low, high = intervals.wilson(8, 20)
    assert rows[2] == ["far", f"40.0 [{100 * low:.0f}, {100 * high:.0f}]*†"]
    assert rows[1][1].startswith("**90.0** [") and rows[3] == ["none", "-"]
    legend = cells.legend({"wilson"})
    assert "Wilson" in legend and "bootstrap (" not in legend and "`*`" in legend and "`†`" in legend


def test_half_width_text() -> None:
    assert cells.half_width_text(20) == (
        "a cell near 50% has a 95% interval of ±20 points (Wilson; ±5 needs 385 samples)"
    )
