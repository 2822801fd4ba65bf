"""``kvlab predict --help``: every field a run config may set, group by group, from the code itself.

The ``model`` and ``data`` fields are the config fields of ``KVLabModule`` and ``KVLabDataModule``
(:func:`kvlab.runner.plan.config_fields`) with their defaults and the first sentence of their
docstring's ``Args:`` entry; ``trainer`` lists Lightning's Trainer arguments a run may set.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from typing import Any

from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.module import KVLabModule
from kvlab.runner.plan import DEFAULT_SEED, RUN_DEFAULTS, TRAINER_DEFAULTS, config_fields, trainer_fields

USAGE = """\
usage: kvlab predict [--config FILE_OR_PRESET ...] [--GROUP.FIELD VALUE ...] [--print_config] [--help]

Runs a method on a dataset and writes <run.dir>/<run.experiment>/<run.method>/ (config.yaml,
run.json, predictions.jsonl, metrics.json, TensorBoard events). Presets and files merge left to
right; --GROUP.FIELD VALUE overrides one field (a YAML value; a comma list in a sweep field runs
one point per value); --GROUP FILE merges a file of the group's fields. Options are matched
exactly. --print_config prints the resolved config of the run (what config.yaml records) and exits.
"""
RUN_HELP = {
    "dir": "root of run directories",
    "experiment": "experiment name (a directory under run.dir)",
    "method": "method name (default: the first config's name, plus the overrides that change results)",
    "overwrite": "delete the run directory's results before running (needed to reuse the directory of a "
    "run with a different fingerprint)",
}


def arg_docs(cls: type) -> dict[str, str]:
    """The first sentence of each entry of the ``Args:`` sections of ``cls``'s docstring."""
    docs: dict[str, str] = {}
    name = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry:
            name, docs[entry.group(1)] = entry.group(1), entry.group(2)
        elif name is not None and line.startswith(" " * 8):
            docs[name] += " " + line.strip()
        else:
            name = None
    return {key: first_sentence(text) for key, text in docs.items()}


def first_sentence(text: str) -> str:
    """``text`` up to its first full stop followed by a space (all of it when there is none)."""
    match = re.search(r"\.\s", text + " ")
    return text[: match.start() + 1] if match else text


def field_line(group: str, name: str, default: Any, about: str = "") -> str:
    """One option: ``--group.name`` with its default, then its description wrapped beneath."""
    plain = default is None or isinstance(default, bool | int | float)
    shown = json.dumps(default) if plain else repr(default)
    head = f"  --{group}.{name} (default: {shown})"
    if not about:
        return head
    return head + "\n" + textwrap.fill(about, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)


def predict_help() -> str:
    """The text of ``kvlab predict --help``."""
    parts = [USAGE]
    for group, cls in (("model", KVLabModule), ("data", KVLabDataModule)):
        docs = arg_docs(cls)
        parts.append(f"{group}:")
        for name, param in config_fields(cls).items():
            if group == "data" and name == "model":  # model.model names it
                continue
            parts.append(field_line(group, name, param.default, docs.get(name, "")))
        parts.append("")
    parts.append("run:")
    parts += [field_line("run", name, default, RUN_HELP[name]) for name, default in RUN_DEFAULTS.items()]
    parts.append("")
    parts.append(f"  --seed_everything N (default: {DEFAULT_SEED}): the seed of the run (false: no seeding)")
    parts.append("")
    parts.append("trainer (Lightning's Trainer arguments; kvlab owns the logger and the callbacks):")
    for name, param in trainer_fields().items():
        parts.append(field_line("trainer", name, TRAINER_DEFAULTS.get(name, param.default)))
    return "\n".join(parts)
