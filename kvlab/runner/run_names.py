"""Run names: how a run's directory name records its overrides and sweep point, and how it is read back.

A run of ``kvlab predict`` is named ``<method>[@<key>=<value>[,<key>=<value>]]`` (``key``
without its ``model.compression.``, ``data.dataset.`` or ``model.`` prefix), e.g.
``runs/<experiment>/snapkv@budget=32/``: the command line writes the names
(:func:`override_suffix`, and each point of a sweep, :mod:`kvlab.cli.sweep`) and ``kvlab
compare`` reads the values back from the directory names (:func:`parse_method`).

Command-line overrides name a run in the order given: ``kvlab predict --config my_hybrid.yaml
--model.compression.budget.ratio 0.1`` writes ``runs/<experiment>/my_hybrid@budget.ratio=0.1/``.
A mapping value names each of its leaves (``--data.dataset '{name: jsonl, path: data/qa.jsonl}'``
-> ``name=jsonl,path=qa.jsonl``: a path by its file name).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from kvlab.config.loader import split_values

SHORT_PREFIXES = ("model.compression.", "data.dataset.", "model.")
MAX_SUFFIX = 120  # longer override suffixes are cut and end with a hash of the whole text


def short_key(dotted: str) -> str:
    """``model.compression.budget.tokens`` -> ``budget.tokens`` (the name used in method names)."""
    for prefix in SHORT_PREFIXES:
        if dotted.startswith(prefix):
            return dotted[len(prefix) :]
    return dotted


def value_text(value: Any) -> str:
    """A value as written in a method name (scalars as is, others as compact JSON)."""
    text = (
        str(value)
        if isinstance(value, str | int | float | bool)
        else json.dumps(value, separators=(",", ":"))
    )
    return text.replace("/", "_")


def parse_method(name: str) -> tuple[str, dict[str, str]]:
    """``snapkv@budget=32,window=8`` -> ``("snapkv", {"budget": "32", "window": "8"})``."""
    base, _, point = name.partition("@")
    values: dict[str, str] = {}
    for part in split_values(point) if point else []:
        key, _, value = part.partition("=")
        values[key] = value
    return base, values


def _leaves(dotted: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for key, item in value.items() for leaf in _leaves(f"{dotted}.{key}", item)]
    return [(dotted, value)]


def override_suffix(overrides: list[tuple[str, str]]) -> str:
    """The run-name suffix of command-line overrides: ``key=value`` parts joined by commas.

    ``[("model.compression.budget.ratio", "0.1")]`` -> ``"budget.ratio=0.1"``. Values are parsed
    as YAML; a mapping names each leaf; a string holding ``/`` (a path) is named by its last
    part; a later override of the same key replaces the earlier one. A suffix longer than 120
    characters is cut and ends with ``~`` and 8 hex digits of the whole (the run's fingerprint,
    not its name, decides whether two runs are the same).
    """
    parts: dict[str, str] = {}
    for dotted, text in overrides:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        for key, leaf in _leaves(dotted, value):
            if isinstance(leaf, str) and "/" in leaf:
                leaf = Path(leaf).name or leaf
            parts.pop(short_key(key), None)
            parts[short_key(key)] = value_text(leaf)
    suffix = ",".join(f"{key}={value}" for key, value in parts.items())
    if len(suffix) > MAX_SUFFIX:
        digest = hashlib.sha256(suffix.encode()).hexdigest()[:8]
        suffix = f"{suffix[: MAX_SUFFIX - 9]}~{digest}"
    return suffix
