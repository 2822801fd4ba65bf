"""Short figure titles: the method, its budget and the sample, on one line."""

from __future__ import annotations

from typing import Any

from kvlab.runner.run_names import parse_method


def run_label(method: str | None, pipeline: Any) -> str:
    """``"<method> · <budget>"``, e.g. ``snapkv · 128 tok/head, window 32``.

    ``method`` is the run's name; only its family is kept (``snapkv@budget.tokens=128,model=x`` ->
    ``snapkv``: the budget is stated from the pipeline itself, and TensorBoard names the run).
    """
    budget = getattr(pipeline, "budget", None)
    if budget is None or not getattr(pipeline, "compresses", True):
        text = "full cache"
    else:
        size = f"{budget.tokens} tok/head" if budget.tokens is not None else f"ratio {budget.ratio:g}"
        text = f"{size}, window {budget.window:g}" + (f", {budget.sinks} sinks" if budget.sinks else "")
    family = parse_method(method)[0] if method else None
    return f"{family} · {text}" if family else text


def titled(label: str, *parts: str) -> str:
    """A figure title of two short lines: ``label`` (method and budget), then the parts joined by
    `` · `` (sample, layer, image); one line when either is empty."""
    rest = " · ".join(p for p in parts if p)
    return "\n".join(line for line in (label, rest) if line)
