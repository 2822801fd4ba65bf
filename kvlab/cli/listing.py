"""``kvlab list``: every registry with its kind and YAML field, each component's parameters and
defaults, then the presets."""

from __future__ import annotations

import sys
from typing import Any

# imported for their registries: each Registry enrols itself in REGISTRIES when it is created, and
# importing kvlab.compression registers every component module
import kvlab.calibration.prefixkv  # noqa: F401  (PrefixKV's statistic: registered whatever the import order)
import kvlab.calibration.statistics  # noqa: F401
import kvlab.compression  # noqa: F401
import kvlab.data  # noqa: F401
import kvlab.engine.protocols  # noqa: F401
import kvlab.models  # noqa: F401
from kvlab.config.loader import preset_names
from kvlab.config.plugins import load_entry_points
from kvlab.config.registry import REGISTRIES, Registry


def print_components(out: Any = None) -> None:
    """For every registry its kind and YAML field (the role its components play), each component
    with parameters and defaults; then the presets."""
    out = out or sys.stdout
    for registry in sorted(all_registries(), key=lambda r: r.field):
        print(f"{plural(registry.kind)}  (YAML field: {registry.field})", file=out)
        for name, doc, params, capabilities in registry.describe():
            print(f"  {name}: {doc}", file=out)
            if capabilities is not None:
                print(f"      capabilities: {capabilities}", file=out)
            for param, type_name, default in params:
                print(f"      {param}: {type_name} = {default}", file=out)
        print(file=out)
    print("presets  (kvlab predict --config NAME)", file=out)
    print("  " + ", ".join(preset_names()), file=out)


def plural(kind: str) -> str:
    """``"decode policy"`` -> ``"decode policies"``, ``"mixer"`` -> ``"mixers"``."""
    if kind.endswith("y") and kind[-2:-1] not in tuple("aeiou"):
        return kind[:-1] + "ies"
    return kind + "s"


def all_registries() -> list[Registry[Any]]:
    """Every registry, as enrolled on creation (this module imports the packages that define
    them), plus those of the installed plugins (``kvlab.plugins`` entry points)."""
    load_entry_points()
    return list(REGISTRIES)


def main(args: list[str]) -> None:
    """``kvlab list``."""
    print_components()
