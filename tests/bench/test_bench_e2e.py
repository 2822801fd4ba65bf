"""``kvlab bench e2e --quick``: a smoke test of the plumbing through the CLI (the table's rows and
columns appear); nothing is asserted about speed."""

from kvlab.bench.e2e import BASELINE, HEADERS, METHODS
from kvlab.cli.main import main


def test_quick_prints_every_row_and_column(capsys):
    main(["bench", "e2e", "--quick", "--threads", "1"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| " + " | ".join(HEADERS) + " |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    caches = [BASELINE] + [f"kvlab {m}" + ("" if r is None else f" {r:.0%}") for m, r in METHODS]
    cells = {(row[0], row[1], row[2]) for row in rows}
    expected = {("quick shape", c, b) for c in ("256", "1k") for b in ("1", "2")}
    assert cells == expected | {("smollm2-135m (fp32, CPU)", "256", "1")}
    for cell in cells:
        assert [row[3] for row in rows if (row[0], row[1], row[2]) == cell] == caches
    assert all(len(row) == len(HEADERS) and "OOM" not in row for row in rows)
    baseline = next(row for row in rows if row[3] == BASELINE)
    assert baseline[8:] == ["1.00", "1.00", "n/a", "1.00"]  # ratios to itself; no peak on CPU
    assert "kvpress rows: not measured (no --kvpress-python given)" in out
