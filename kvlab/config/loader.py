"""Config files: finding presets by bare name, ``preset:`` inheritance, and dotted overrides.

- ``--config snapkv.yaml`` (or ``snapkv``) finds a file in the working directory first, then
  among the presets shipped in ``kvlab/configs``.
- A config may start with ``preset: <name or path>``: the preset is loaded (recursively) and
  the file's own fields are merged on top, field by field. Lists are replaced whole, and so is
  a component node (a mapping with ``name``) whose ``name`` changes: the old component's
  parameters do not leak into the new one. Setting one of a group of exclusive fields
  (a budget's ``tokens`` / ``ratio``) drops the others.
- ``--model.compression.<...> VALUE`` and ``--data.dataset.<...> VALUE`` on the command line
  are merged into the resolved config the same way (values parsed as YAML), so
  ``--model.compression.budget.tokens 128`` changes the budget and keeps its window; so are
  every other ``--model.*``, ``--data.*``, ``--trainer.*`` and ``--run.*`` option.
- Configs hold plain values, read by :func:`kvlab.config.yaml_text.parse_yaml`: YAML tags
  (``!!python/object/apply:...``), duplicate keys, alias bombs, absurd nesting and non-UTF-8
  files are refused, and so are omegaconf interpolations and resolvers (``${model.model}``,
  ``${oc.env:HOME}``): kvlab does not evaluate them, so a value containing ``${`` is an error
  naming the field, not a literal.
- ``imports: [module, path/to/file.py]`` lists user plugin modules (:mod:`kvlab.config.plugins`):
  ``.py`` paths are made absolute against the file that lists them, and the lists of a config
  and of the presets it inherits are concatenated (not replaced).
"""

from __future__ import annotations

import inspect
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.plugins import IMPORTS_KEY, resolve_imports
from kvlab.config.registry import _matches, _type_name
from kvlab.config.yaml_text import load_yaml_file, parse_yaml, read_text

PRESET_KEY = "preset"
#: the config groups whose ``--group.field VALUE`` options kvlab merges itself (``seed_everything`` too)
OVERRIDE_GROUPS = ("model", "data", "trainer", "run")
#: ``--group FILE``: a YAML file holding one group's fields
GROUP_FILES = ("model", "data", "trainer")
#: fields whose comma lists sweep (one run per value)
SWEEPABLE_PREFIXES = ("model.", "data.")
#: fields that hold names or paths: an override's text is taken as it is, not parsed as YAML
TEXT_FIELDS = frozenset({"model.model", "run.dir", "run.experiment", "run.method", "data.chat_template"})
#: what a second ``--config`` may set (an empty tuple: the whole group)
LATER_CONFIG_FIELDS: dict[str, tuple[str, ...]] = {
    "data": (),
    "trainer": (),
    "run": ("experiment", "dir"),
    "model": ("protocol", "max_new_tokens"),
}
# fields of which a node holds at most one: an override naming one drops the others
EXCLUSIVE_FIELDS = (("tokens", "ratio"), ("context_words", "context_tokens"))


def presets_dir() -> Path:
    """Directory of the YAML presets shipped with the package."""
    return Path(str(resources.files("kvlab.configs")))


def preset_names(directory: Path | None = None) -> list[str]:
    """Names of the shipped presets (files starting with ``_`` are building blocks, not listed)."""
    return sorted(p.stem for p in (directory or presets_dir()).glob("*.yaml") if not p.stem.startswith("_"))


def find_config(
    name: str, relative_to: Path | None = None, shipped: Path | None = None, kind: str = "preset"
) -> Path:
    """Resolve a config reference to a file: a path (absolute, relative to ``relative_to`` or the
    working directory) or the name of a file shipped in ``shipped`` (default: the presets), with or
    without ``.yaml``. ``kind`` names what is shipped there in the error message."""
    directory = shipped or presets_dir()
    candidates = [Path(name)]
    if relative_to is not None:
        candidates.insert(0, relative_to / name)
    stem = name[:-5] if name.endswith(".yaml") else name
    candidates.append(directory / f"{stem}.yaml")
    for path in candidates:
        if path.is_file():
            return path
    names = preset_names(directory)
    raise ConfigError(
        f"Config '{name}' not found: it is neither a file (relative to {Path.cwd()}) nor a shipped {kind}."
        f"{did_you_mean(stem, names)} Shipped {kind}s: {', '.join(names)}."
    )


def merge(base: Any, override: Any) -> Any:
    """Merge ``override`` into ``base`` (new objects; see the module docstring for the rules)."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    if "name" in override and override.get("name") != base.get("name"):
        return override
    merged = dict(base)
    for group in EXCLUSIVE_FIELDS:
        if any(key in override for key in group):
            for key in group:
                if key not in override:
                    merged.pop(key, None)
    for key, value in override.items():
        merged[key] = merge(base[key], value) if key in base else value
    return merged


def load_config(name: str, relative_to: Path | None = None, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load a config and everything it inherits through ``preset:``; returns the merged config."""
    path = find_config(name, relative_to).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"preset cycle: {chain}. Remove one of the `preset:` lines.")
    raw = load_yaml_file(path)
    reject_interpolation(raw, str(path))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must contain a YAML mapping at the top level, got {type(raw).__name__}.")
    parent = raw.pop(PRESET_KEY, None)
    imports = resolve_imports(raw.pop(IMPORTS_KEY, None), path.parent)
    if parent is None:
        return with_imports(raw, imports)
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: `{PRESET_KEY}` must be a preset name or a path, got {parent!r}.")
    base = load_config(parent, relative_to=path.parent, _seen=(*_seen, path))
    return with_imports(merge(base, raw), imports)


def reject_interpolation(node: Any, where: str, field: str = "") -> None:
    """Raise :class:`ConfigError` for any string in ``node`` holding an omegaconf interpolation or
    resolver (``${...}``): kvlab does not evaluate them (they could read the environment or call
    registered resolvers), and taking them literally would hide the mistake."""
    if isinstance(node, dict):
        for key, value in node.items():
            reject_interpolation(value, where, f"{field}.{key}" if field else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            reject_interpolation(value, where, f"{field}[{index}]")
    elif isinstance(node, str) and "${" in node:
        raise ConfigError(
            f"{where}: {field or 'the value'} = {node!r} uses an interpolation or resolver (`${{...}}`), "
            "which kvlab does not evaluate. Write the value itself; to use an environment variable, let "
            'the shell expand it on the command line (e.g. --run.dir "$HOME/runs").'
        )


def check_fields(cfg: dict[str, Any], sections: dict[str, Any]) -> None:
    """Check the fields of ``cfg``'s sections against the signatures of the classes they configure
    (``{"model": KVLabModule, "data": KVLabDataModule}``): an unknown field (with the closest
    match) or a value of the wrong type (for simple hints) is a one-paragraph :class:`ConfigError`."""
    for section, cls in sections.items():
        node = cfg.get(section)
        if node is None:
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"`{section}` must be a mapping of fields, got {node!r}. Fix the config.")
        params = {
            name: param
            for name, param in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.POSITIONAL_ONLY)
        }  # keyword-only parameters are wired by the run's driver, never set by a config
        hints = _hints(cls.__init__)
        for key, value in node.items():
            if key not in params:
                raise ConfigError(
                    f"unknown field {section}.{key}.{did_you_mean(key, params)} The fields of `{section}` "
                    f"are: {', '.join(params)}. Fix or remove it."
                )
            tp = hints.get(key)
            if tp is not None and not _matches(value, tp):
                raise ConfigError(
                    f"{section}.{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}). "
                    "Fix the value."
                )


def _hints(function: Any) -> dict[str, Any]:
    """Resolved type hints of ``function`` (empty when they cannot be evaluated)."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # hints naming types unavailable at runtime: skip type checks
        return {}


def with_imports(cfg: dict[str, Any], imports: list[str]) -> dict[str, Any]:
    """``cfg`` with ``imports`` appended to its own ``imports`` list (duplicates dropped)."""
    if not imports:
        return cfg
    merged = list(dict.fromkeys([*cfg.get(IMPORTS_KEY, []), *imports]))
    return {**cfg, IMPORTS_KEY: merged}


def apply_override(cfg: dict[str, Any], dotted: str, value_text: str) -> dict[str, Any]:
    """Return ``cfg`` with ``dotted = yaml(value_text)`` merged in (same rules as presets).

    A field that holds a name or a path (:data:`TEXT_FIELDS`) takes ``value_text`` as it is, so
    ``--run.method 0.1`` names a run ``0.1`` rather than failing as a number."""
    value = parse_override(dotted, value_text, f"--{dotted}")
    for key in reversed(dotted.split(".")):
        value = {key: value}
    return merge(cfg, value)


def parse_override(dotted: str, text: str, where: str) -> Any:
    """The value of ``--dotted TEXT``: YAML, except that a name or path field (:data:`TEXT_FIELDS`)
    takes the text as it is, and only ``true`` / ``false`` are booleans (YAML 1.1 would read
    ``--model.verify off`` as ``False``). Interpolations are refused."""
    if dotted in TEXT_FIELDS:
        value: Any = text
    else:
        value = parse_yaml(text, where)
        if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
            value = text.strip()
    reject_interpolation(value, where, dotted)
    return value


def is_override(option: str) -> bool:
    """Whether ``--option`` sets a config field that kvlab merges itself (:data:`OVERRIDE_GROUPS`)."""
    group, dot, field = option.partition(".")
    if group == "seed_everything":
        return not dot
    return group in OVERRIDE_GROUPS and bool(dot) and all(field.split("."))


def is_sweepable(dotted: str) -> bool:
    """Whether a comma list on ``--dotted`` sweeps it (one run per value)."""
    return dotted == "seed_everything" or dotted.startswith(SWEEPABLE_PREFIXES)


def split_overrides(args: list[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Separate ``--config`` files and field overrides from the other CLI arguments.

    Every ``--model.*``, ``--data.*``, ``--trainer.*``, ``--run.*`` and ``--seed_everything``
    option is an override that kvlab merges into the resolved config itself (so the whole run is
    one config, validated in one place), and so is a group file (``--trainer trainer.yaml``,
    read like a config file). Options are matched exactly (never by prefix). What remains are
    the command's flags (``--print_config``, ``--help``).

    Returns ``(config_names, passthrough_args, [(dotted_key, value_text)])``; a group file is
    ``(group, its text)``.
    """
    configs: list[str] = []
    rest: list[str] = []
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, inline = arg.partition("=")
        option = key[2:] if key.startswith("--") else ""
        takes_value = key in ("--config", "-c") or is_override(option) or option in GROUP_FILES
        if takes_value and not eq:
            if i + 1 >= len(args):
                example = "`--config snapkv.yaml`" if option in ("config", "") else f"`--{option} VALUE`"
                raise ConfigError(f"{key} needs a value, e.g. {example}.")
            inline, i = args[i + 1], i + 1
        if key in ("--config", "-c"):
            configs.append(inline)
        elif option in GROUP_FILES:
            path = Path(inline).expanduser()
            if not path.is_file():
                raise ConfigError(
                    f"--{option} {inline!r}: a group option takes the path of a YAML file holding the "
                    f"`{option}` fields, and {path} is not a file. Set single fields with "
                    f"--{option}.<field> VALUE instead."
                )
            node = load_yaml_file(path)
            reject_interpolation(node, str(path), option)
            if node is not None and not isinstance(node, dict):
                raise ConfigError(f"{path} must hold a mapping of `{option}` fields, got {node!r}.")
            overrides.append((option, read_text(path)))
        elif takes_value:
            if not is_sweepable(option) and not option.startswith("trainer.") and is_comma_list(inline):
                raise ConfigError(
                    f"--{option} {inline!r}: a comma list sweeps only model.*, data.* and seed_everything "
                    f"fields (one run per value), and {option} cannot be swept. Give one value, or run "
                    "one command per value."
                )
            overrides.append((option, inline))
        else:
            if "${" in arg:  # a flag's value: refused like interpolations in config files
                where = key if key.startswith("--") else (args[i - 1] if i else "argument")
                reject_interpolation(inline if eq else arg, "the command line", where.lstrip("-"))
            rest.append(arg)
        i += 1
    return configs, rest, overrides


def check_later_config(name: str, loaded: dict[str, Any]) -> None:
    """Refuse a second (third, ...) ``--config`` that sets what the first one owns: the method.

    Several ``--config`` files merge in order under one rule (docs/benchmark_suites.md): the
    first names the method and the run; every later one is an evaluation config (a benchmark
    suite such as ``benchmarks/ruler``) and may set only :data:`LATER_CONFIG_FIELDS`.
    """
    allowed = {group: set(fields) for group, fields in LATER_CONFIG_FIELDS.items()}
    for group, node in loaded.items():
        if group not in allowed:
            raise ConfigError(
                f"--config {name} sets `{group}`, but only the first --config may set the method and its "
                f"run name; a later --config is an evaluation config (such as benchmarks/ruler) and may "
                f"set only {_later_fields()}. Give the method first, or write one YAML file that starts "
                f"with `preset: <method>` and sets the fields to change."
            )
        if allowed[group] and isinstance(node, dict):
            extra = sorted(set(node) - allowed[group])
            if extra:
                raise ConfigError(
                    f"--config {name} sets {group}.{extra[0]}, but only the first --config may set the "
                    f"method and its run name; a later --config (an evaluation config such as "
                    f"benchmarks/ruler) may set only {_later_fields()}. Move {group}.{extra[0]} into the "
                    "first config (or a YAML file with `preset: <method>`)."
                )


def _later_fields() -> str:
    return ", ".join(
        f"{group}.{{{', '.join(fields)}}}" if fields else group
        for group, fields in LATER_CONFIG_FIELDS.items()
    )


def resolve(configs: list[str], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Merge the given configs (a later evaluation config on top, :func:`check_later_config`) and
    the overrides into one plain dict."""
    cfg: dict[str, Any] = {}
    for index, name in enumerate(configs):
        loaded = load_config(name)
        if index:
            check_later_config(name, loaded)
        earlier = cfg.get(IMPORTS_KEY, [])
        cfg = with_imports({**merge(cfg, loaded), IMPORTS_KEY: earlier}, loaded.get(IMPORTS_KEY, []))
        if not cfg[IMPORTS_KEY]:
            del cfg[IMPORTS_KEY]
    for dotted, value in overrides:
        cfg = apply_override(cfg, dotted, value)
    return cfg


def is_comma_list(text: str) -> bool:
    """Whether ``text`` is a comma list (``a,b``), not a single value holding commas in brackets or
    a run name whose commas follow its ``@`` (``snapkv@budget=32,window=8``)."""
    parts = split_values(text)
    return len(parts) > 1 and "@" not in parts[0]


def split_values(text: str) -> list[str]:
    """Split ``text`` at the commas outside brackets and braces (``"32,64"`` -> ``["32", "64"]``)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return parts


def imports_by_config(configs: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """``(imports entry, the config file that lists it)`` for the ``imports`` of ``configs`` and of
    every preset they inherit (the file nearest the command line first), as :func:`resolve` reads them."""
    found: list[tuple[str, str]] = []

    def walk(name: str, relative_to: Path | None) -> None:
        path = find_config(name, relative_to).resolve()
        raw = load_yaml_file(path)
        if not isinstance(raw, dict):
            return
        found.extend((entry, str(path)) for entry in resolve_imports(raw.get(IMPORTS_KEY), path.parent))
        if isinstance(raw.get(PRESET_KEY), str):
            walk(raw[PRESET_KEY], path.parent)

    for name in configs:
        walk(name, None)
    return found
