"""Sweeps: one ``kvlab predict`` command, one run per value (or per combination of values).

Two ways to ask for one:

- a comma list on a ``--model.*``, ``--data.*`` or ``--seed_everything`` override:
  ``--model.compression.budget 32,64,128`` (commas
  inside ``[...]`` or ``{...}`` do not split, so ``--model.compression.importance
  "[{name: a}, {name: b}]"`` stays one value);
- a ``sweep:`` block in the YAML config, dotted keys to lists of values (any key of the
  resolved config: ``model.compression.*``, ``model.max_new_tokens``, ``data.dataset.*``)::

      sweep:
        model.compression.budget.tokens: [32, 64, 128]

Several swept keys give their cartesian product. Each point runs as its own method
``<method>@<key>=<value>[,<key>=<value>]`` (the run-name convention of
:mod:`kvlab.runner.run_names`), e.g. ``runs/<experiment>/snapkv@budget=32/``, so the points sit
next to the other methods of the experiment and ``kvlab compare`` reads the swept values back
from the directory names.

Command-line overrides name a run the same way: every override of a field that changes results
(the run's fingerprint, :mod:`kvlab.runner.fingerprint`: ``--model.compression.*``,
``--data.dataset*``, ``--model.max_new_tokens``, ``--model.model``, ...; not ``--trainer.*``,
``--data.batch_size`` or the TensorBoard options) is appended as ``@key=value[,key=value]``, in
the order given (``model.compression.*`` and ``data.dataset.*`` first), before any swept values
(:func:`naming_overrides`, :func:`kvlab.runner.run_names.override_suffix`). An explicit
``--run.method`` wins: no override suffix (a sweep still appends its point). A comma list on
any other option is refused (``--trainer.*`` values keep Lightning's own syntax, e.g.
``--trainer.devices 0,1``).
"""

from __future__ import annotations

import itertools
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.loader import is_sweepable, merge, parse_override
from kvlab.runner.fingerprint import DATA_EXCLUDED, MODEL_EXCLUDED
from kvlab.runner.run_names import short_key, split_values, value_text

SWEEP_KEY = "sweep"


def set_dotted(cfg: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """``cfg`` with ``dotted = value`` merged in (the same rules as presets and overrides)."""
    for key in reversed(dotted.split(".")):
        value = {key: value}
    return merge(cfg, value)


def yaml_sweep(node: Any) -> list[tuple[str, list[Any]]]:
    """The ``sweep:`` block as ``[(dotted key, values)]`` (validated)."""
    if not isinstance(node, dict) or not node:
        raise ConfigError(
            f"`{SWEEP_KEY}:` must map dotted keys to lists of values, e.g. "
            "`sweep: {model.compression.budget.tokens: [32, 64, 128]}`; got {node!r}."
        )
    out = []
    for key, values in node.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{SWEEP_KEY}.{key} must be a non-empty list of values, got {values!r}; "
                f"e.g. `{key}: [32, 64, 128]`."
            )
        out.append((str(key), values))
    return out


def cli_sweep(overrides: list[tuple[str, str]]) -> list[tuple[str, list[Any]]]:
    """The sweepable overrides that hold comma lists, as ``[(dotted key, parsed values)]``; each
    value is read and checked on its own (a broken part is an error naming it)."""
    out = []
    for dotted, text in overrides:
        parts = split_values(text) if is_sweepable(dotted) else [text]
        if len(parts) > 1:
            if not all(parts):
                raise ConfigError(f"--{dotted} {text!r}: a sweep needs a value between every pair of commas.")
            values = []
            for number, part in enumerate(parts, start=1):
                where = f"--{dotted} (value {number} of the sweep, {part!r})"
                values.append(parse_override(dotted, part, where))
            out.append((dotted, values))
    return out


def expand(resolved: dict[str, Any], overrides: list[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
    """Sweep points of a resolved config: ``[(method suffix, config)]``; ``[("", config)]`` without a sweep.

    ``resolved`` is the config with every override merged (a swept override's comma text is
    replaced by each value in turn); its ``sweep:`` block is removed.
    """
    resolved = dict(resolved)
    axes = cli_sweep(overrides)
    if SWEEP_KEY in resolved:
        axes += yaml_sweep(resolved.pop(SWEEP_KEY))
    if not axes:
        return [("", resolved)]
    points = []
    for values in itertools.product(*(vals for _, vals in axes)):
        cfg = resolved
        for (dotted, _), value in zip(axes, values, strict=True):
            cfg = set_dotted(cfg, dotted, value)
        suffix = ",".join(f"{short_key(d)}={value_text(v)}" for (d, _), v in zip(axes, values, strict=True))
        points.append((suffix, cfg))
    return points


def names_run(dotted: str) -> bool:
    """Whether an override of ``dotted`` changes results (is in the run's fingerprint), so names the run."""
    group, _, field = dotted.partition(".")
    field = field.split(".")[0]
    if group == "model":
        return bool(field) and field not in MODEL_EXCLUDED
    if group == "data":
        return bool(field) and field not in DATA_EXCLUDED
    return dotted in ("seed_everything", "trainer.precision")


def naming_overrides(overrides: list[tuple[str, str]], swept: set[str]) -> list[tuple[str, str]]:
    """The command-line overrides that name the run (:func:`names_run`, not swept), the
    ``model.compression.*`` and ``data.dataset.*`` ones first, each group in the order given."""
    named = [(dotted, text) for dotted, text in overrides if dotted not in swept and names_run(dotted)]
    first = [o for o in named if o[0].startswith(("model.compression", "data.dataset"))]
    return first + [o for o in named if o not in first]
