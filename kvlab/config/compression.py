"""The ``model.compression`` node of a preset, a YAML file or a dict, with overrides merged.

:func:`compression_config` is what :func:`kvlab.load_pipeline` builds a pipeline from (and is
exported as :func:`kvlab.compression_config`): it resolves a source with the preset rules of
:mod:`kvlab.config.loader` and imports the plugins a run config lists, without building anything.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.loader import find_config, load_config, merge
from kvlab.config.plugins import IMPORTS_KEY, check_imports, import_plugins
from kvlab.config.registry import to_plain
from kvlab.config.yaml_text import load_yaml_file

#: top-level groups of a run config (``kvlab predict --config``); a mapping without them is a
#: bare ``model.compression`` node
RUN_GROUPS = ("model", "data", "trainer", "run")
OVERRIDE_PREFIX = "model.compression."

#: what :func:`compression_config` resolves: a preset name, a YAML path, a mapping, or None (full cache)
PipelineSource = str | os.PathLike | Mapping[str, Any] | None


def compression_config(
    source: PipelineSource, overrides: Mapping[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """The resolved ``model.compression`` mapping of ``source`` with ``overrides`` merged in.

    Args:
        source: a preset name (``"snapkv"``), a YAML path, or a dict. A file or dict holding a run
            config (``model:``/``data:``/``run:`` groups, optionally ``preset: NAME``) gives its
            ``model.compression``; any other mapping is a compression node itself (it may start
            with ``preset: NAME`` to inherit that preset's pipeline). ``None`` or ``{}``: full cache.
        overrides: fields to change, keyed by dotted paths inside the compression node
            (``{"budget.tokens": 64}``; a leading ``model.compression.`` is allowed) or by field
            with nested mappings (``{"budget": {"tokens": 64}}``). Merged with the preset rules of
            :func:`kvlab.config.loader.merge`: siblings are kept, lists and renamed components
            (a new ``name``) are replaced whole, ``tokens`` replaces ``ratio`` and vice versa.
        fields: more overrides as keyword arguments (``budget={"tokens": 64}``), applied last.

    Returns:
        A new plain dict (validated only when a pipeline is built from it).

    Raises:
        ConfigError: unknown preset or file, invalid YAML, a source or override of the wrong type.
    """
    node = _compression_node(source)
    for key, value in [*(overrides or {}).items(), *fields.items()]:
        node = merge(node, _nest(key, value))
    return node


def _compression_node(source: PipelineSource) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, str | os.PathLike):
        path = find_config(str(source))
        raw = load_yaml_file(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path} must contain a YAML mapping at the top level, got {type(raw).__name__}."
            )
        if _is_run_config(raw):
            return _from_run_config(load_config(str(path)), str(path))
        return _from_mapping(raw, relative_to=path.parent)
    source = to_plain(source)
    if isinstance(source, Mapping):
        return _from_mapping(copy.deepcopy(dict(source)), relative_to=None)
    raise ConfigError(
        f"A pipeline source must be a preset name, a YAML path or a dict, got {type(source).__name__}: "
        f"{source!r}. Example: kvlab.load_pipeline('snapkv', {{'budget.tokens': 64}})."
    )


def _is_run_config(node: Mapping[str, Any]) -> bool:
    return isinstance(node.get("model"), Mapping) or any(key in node for key in RUN_GROUPS[1:])


def _from_mapping(node: dict[str, Any], relative_to: Path | None) -> dict[str, Any]:
    """A dict source: a run config (its ``model.compression``) or a compression node."""
    parent = node.pop("preset", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(f"`preset` must be a preset name or a path, got {parent!r}.")
    if _is_run_config(node):
        base = load_config(parent, relative_to=relative_to) if parent else {}
        return _from_run_config(merge(base, node), "the given config")
    base = _from_run_config(load_config(parent, relative_to=relative_to), parent) if parent else {}
    return merge(base, node)


def _from_run_config(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A run config's ``model.compression``, after importing the plugins its ``imports`` lists."""
    import_plugins(check_imports(cfg.get(IMPORTS_KEY)))
    model = cfg.get("model") or {}
    if not isinstance(model, Mapping):
        raise ConfigError(f"{where}: `model` must be a mapping, got {model!r}.")
    node = model.get("compression") or {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: model.compression must be a mapping, got {node!r}.")
    return copy.deepcopy(dict(node))


def _nest(key: Any, value: Any) -> dict[str, Any]:
    """``("budget.tokens", 64)`` -> ``{"budget": {"tokens": 64}}``."""
    if not isinstance(key, str) or not key.strip("."):
        raise ConfigError(
            f"Override keys must be field names or dotted paths such as 'budget.tokens', got {key!r}."
        )
    key = key.removeprefix(OVERRIDE_PREFIX)
    value = to_plain(value)
    for part in reversed(key.split(".")):
        value = {part: value}
    return value
