"""Display names of an experiment's runs: what varies within the experiment, first.

A run's directory keeps the name ``kvlab predict`` gave it (``snapkv@model=smollm2-135m,budget.ratio=0.1``,
:mod:`kvlab.runner.run_names`); TensorBoard's trials and ``kvlab compare``'s tables and legends
show :func:`display_names` instead, computed over the experiment's runs: the method (the name
before ``@``), then only the values that differ between the runs, the budget first and alone
(``snapkv@10%`` for a ratio of 0.1, ``snapkv@128`` for 128 tokens per KV head), any other
value with its field's last part (``snapkv@10%,window=8``). A value
every run shares (the model of the whole sweep) is left to the columns. TensorBoard cuts a trial
name at about 15 characters: where two names would still agree in their first 15, the values lead
(``10% mixkv_pyramidkv``). Two runs whose values all agree keep their directory names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.runner.leaderboard import BUDGET_KEYS, FULL, budget_point
from kvlab.runner.run_names import SHORT_PREFIXES, parse_method

#: how many leading characters of a trial name TensorBoard shows
SHOWN_CHARACTERS = 15
BUDGET = "budget"


def budget_text(fields: dict[str, Any]) -> str | None:
    """A run's budget size as written in names: ``10%`` (a ratio of 0.1: short, and never mistaken
    for a token count), ``128`` (tokens per KV head), or None for the full cache or a run without
    ``run.json`` fields."""
    if not fields:
        return None
    point = budget_point(fields)
    if point.kind == FULL:
        return None
    return f"{100 * point.value:g}%" if point.kind == "ratio" else f"{int(point.value)}"


def effective_value(fields: dict[str, Any], key: str) -> Any:
    """The value a run used for a name's short key (``window`` -> ``model.compression.window``,
    ``model`` -> ``model.model``), read from its ``run.json`` fields; None where absent."""
    for prefix in (*SHORT_PREFIXES, ""):
        node: Any = fields
        for part in f"{prefix}{key}".split("."):
            if not isinstance(node, dict) or part not in node:
                node = None
                break
            node = node[part]
        if node is not None:
            return node
    return None


def facets(name: str, fields: dict[str, Any], keys: Sequence[str]) -> dict[str, str | None]:
    """``{key: value text}`` of one run for the experiment's name ``keys`` (``budget`` is the budget's
    size whatever its spelling): the value the run used (its fields), else its name's."""
    point = parse_method(name)[1]
    out: dict[str, str | None] = {}
    for key in keys:
        if key == BUDGET:
            written = next((point[k] for k in BUDGET_KEYS if k in point), None)
            out[key] = budget_text(fields) or written
            continue
        value = effective_value(fields, key) if fields else None
        out[key] = str(value) if value is not None and not isinstance(value, dict | list) else point.get(key)
    return out


def _text(key: str, value: str) -> str:
    return value if key == BUDGET else f"{key.rsplit('.', 1)[-1]}={value}"


def display_names(runs: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """``{directory name: display name}`` of an experiment's runs, each given as its directory name
    and its ``run.json`` fields (module docstring: method, then the values that vary)."""
    keys = [BUDGET]
    for name, _ in runs:
        for key in parse_method(name)[1]:
            key = BUDGET if key in BUDGET_KEYS else key
            if key not in keys:
                keys.append(key)
    values = {name: facets(name, fields, keys) for name, fields in runs}
    # a value that differs between the runs that have one (the full cache has no budget)
    varying = [k for k in keys if len({v[k] for v in values.values()} - {None}) > 1]
    parts = {
        name: (parse_method(name)[0], ",".join(_text(k, v[k]) for k in varying if v[k] is not None))
        for name, v in values.items()
    }
    names = {name: f"{family}@{text}" if text else family for name, (family, text) in parts.items()}
    cut = [n[:SHOWN_CHARACTERS] for n in names.values()]
    if len(set(cut)) < len(set(names.values())):  # alike where TensorBoard cuts: the values lead
        names = {name: f"{text} {family}" if text else family for name, (family, text) in parts.items()}
    shown = list(names.values())
    # nothing but their directories tells them apart: the directory names
    return {name: name if shown.count(label) > 1 else label for name, label in names.items()}
