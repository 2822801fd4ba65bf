"""``kvlab compare runs/<experiment>``: methods x metrics, a methods x budget leaderboard, and plots.

The files written and how they are computed: :mod:`kvlab.runner.compare` (``docs/evaluation.md``,
"Comparing runs").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.runner.compare import write_comparison


def main(args: list[str]) -> None:
    """``kvlab compare``: write the comparison files, print the Markdown and the files written."""
    parser = argparse.ArgumentParser(prog="kvlab compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", help="an experiment directory, runs/<experiment>")
    parser.add_argument("--no-plots", action="store_true", help="tables only (no PNG, no TensorBoard)")
    ns = parser.parse_args(args)
    text, written = write_comparison(Path(ns.experiment), plots=not ns.no_plots)
    print(text, end="")
    print(f"kvlab: wrote {', '.join(written)} in {ns.experiment}")
