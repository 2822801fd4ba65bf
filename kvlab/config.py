"""Config files: finding presets by bare name, ``preset:`` inheritance, and dotted overrides.

- ``--config snapkv.yaml`` (or ``snapkv``) finds a file in the working directory first, then
  among the presets shipped in ``kvlab/configs``.
- A config may start with ``preset: <name or path>``: the preset is loaded (recursively) and
  the file's own fields are merged on top, field by field (lists are replaced whole).
- ``--model.compression.<...> VALUE`` and ``--data.dataset.<...> VALUE`` on the command line
  are merged into the resolved config the same way (values parsed as YAML), so
  ``--model.compression.budget.tokens 128`` changes the budget and keeps its window. Other
  dotted options go to LightningCLI unchanged.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from kvlab.errors import ConfigError, did_you_mean

PRESET_KEY = "preset"
MERGED_PREFIXES = ("model.compression", "data.dataset")


def presets_dir() -> Path:
    """Directory of the YAML presets shipped with the package."""
    return Path(str(resources.files("kvlab.configs")))


def preset_names() -> list[str]:
    """Names of the shipped presets (files starting with ``_`` are building blocks, not listed)."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml") if not p.stem.startswith("_"))


def find_config(name: str, relative_to: Path | None = None) -> Path:
    """Resolve a config reference to a file: a path (absolute, relative to ``relative_to`` or the
    working directory) or a shipped preset name with or without ``.yaml``."""
    candidates = [Path(name)]
    if relative_to is not None:
        candidates.insert(0, relative_to / name)
    stem = name[:-5] if name.endswith(".yaml") else name
    candidates.append(presets_dir() / f"{stem}.yaml")
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"Config '{name}' not found: it is neither a file (relative to {Path.cwd()}) nor a shipped preset."
        f"{did_you_mean(stem, preset_names())} Shipped presets: {', '.join(preset_names())}."
    )


def load_config(name: str, relative_to: Path | None = None, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load a config and everything it inherits through ``preset:``; returns the merged config."""
    path = find_config(name, relative_to).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"preset cycle: {chain}. Remove one of the `preset:` lines.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must contain a YAML mapping at the top level, got {type(raw).__name__}.")
    parent = raw.pop(PRESET_KEY, None)
    cfg = OmegaConf.create(raw)
    if parent is None:
        return cfg
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: `{PRESET_KEY}` must be a preset name or a path, got {parent!r}.")
    base = load_config(parent, relative_to=path.parent, _seen=(*_seen, path))
    return OmegaConf.merge(base, cfg)  # type: ignore[return-value]


def apply_override(cfg: DictConfig, dotted: str, value_text: str) -> None:
    """Merge ``dotted = yaml(value_text)`` into ``cfg`` (mappings merge field by field)."""
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--{dotted}: cannot parse {value_text!r} as YAML ({exc}).") from None
    OmegaConf.update(cfg, dotted, value, merge=True, force_add=True)


def split_overrides(args: list[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Separate ``--config`` files and kvlab-merged overrides from the other CLI arguments.

    Returns ``(config_names, passthrough_args, [(dotted_key, value_text)])``.
    """
    configs: list[str] = []
    rest: list[str] = []
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, inline = arg.partition("=")
        if key in ("--config", "-c"):
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError("--config needs a file or preset name, e.g. `--config snapkv.yaml`.")
                inline, i = args[i + 1], i + 1
            configs.append(inline)
        elif key.startswith("--") and key[2:].startswith(MERGED_PREFIXES):
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{key} needs a value.")
                inline, i = args[i + 1], i + 1
            overrides.append((key[2:], inline))
        else:
            rest.append(arg)
        i += 1
    return configs, rest, overrides


def resolve(configs: list[str], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Merge the given configs (later wins) and overrides into one plain dict."""
    cfg = OmegaConf.create({})
    for name in configs:
        cfg = OmegaConf.merge(cfg, load_config(name))
    for dotted, value in overrides:
        apply_override(cfg, dotted, value)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
