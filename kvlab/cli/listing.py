"""``kvlab list``: every registry with its kind and YAML field, each component's parameters and
defaults, then the presets.

``kvlab list --format markdown`` writes the component reference instead: for every registry its
YAML field, and for every component its description, parameters with types and defaults,
capabilities, the paper it follows and the shipped presets that use it. The documentation site
builds its "Component reference" page from :func:`reference_markdown` (``docs/hooks.py``).
"""

from __future__ import annotations

import argparse
import re
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
from kvlab.config.errors import ConfigError
from kvlab.config.loader import preset_names, resolve
from kvlab.config.plugins import load_entry_points
from kvlab.config.registry import REGISTRIES, Registry
from kvlab.engine.protocols import build_protocol
from kvlab.pipeline import Pipeline

#: the registries' order in the reference: a pipeline's slots as a layer runs them, then the rest
ORDER = (
    "model.compression.importance.<role>",
    "model.compression.diversity.<role>",
    "model.compression.mixer",
    "model.compression.allocate.layer",
    "model.compression.allocate.head",
    "model.compression.allocate.modality",
    "model.compression.select",
    "model.compression.route.rule",
    "model.compression.route.rule.metric",
    "model.compression.decode",
    "model.compression.quantize",
    "model.compression.channels",
    "model.protocol",
    "model.model",
    "data.dataset",
    "calibration",
)


def print_components(out: Any = None) -> None:
    """For every registry its kind and YAML field (the role its components play), each component
    with parameters and defaults; then the presets."""
    out = out or sys.stdout
    for registry in sorted(all_registries(), key=lambda r: r.field):
        print(f"{plural(registry.kind)}  (YAML field: {registry.field})", file=out)
        for row in registry.describe():
            print(f"  {row.name}: {row.doc}", file=out)
            if row.capabilities is not None:
                print(f"      capabilities: {row.capabilities}", file=out)
            if row.paper is not None:
                print(f"      paper: {row.paper}", file=out)
            for param, type_name, default in row.params:
                print(f"      {param}: {type_name} = {default}", file=out)
        print(file=out)
    print("presets  (kvlab predict --config NAME)", file=out)
    print("  " + ", ".join(preset_names()), file=out)


def plural(kind: str) -> str:
    """``"decode policy"`` -> ``"decode policies"``, ``"mixer"`` -> ``"mixers"``, ``"retrieval
    index"`` -> ``"retrieval indexes"``."""
    if kind.endswith("y") and kind[-2:-1] not in tuple("aeiou"):
        return kind[:-1] + "ies"
    if kind.endswith(("x", "s", "ch", "sh")):
        return kind + "es"
    return kind + "s"


def all_registries() -> list[Registry[Any]]:
    """Every registry, as enrolled on creation (this module imports the packages that define
    them), plus those of the installed plugins (``kvlab.plugins`` entry points)."""
    load_entry_points()
    return list(REGISTRIES)


def preset_users() -> dict[tuple[str, str], list[str]]:
    """``{(registry field, component name): [preset, ...]}``: which shipped presets use each
    component (every component of the preset's pipeline, its protocol, model and dataset)."""
    by_class: dict[type, list[tuple[str, str]]] = {}
    for registry in all_registries():
        for name in registry.names():
            by_class.setdefault(registry.get(name), []).append((registry.field, name))
    users: dict[tuple[str, str], list[str]] = {}
    for preset in preset_names():
        config = resolve([preset], [])
        model = config.get("model") or {}
        used = []
        try:
            pipeline = Pipeline.from_config(model.get("compression") or {})
        except ConfigError:  # a preset this installation cannot build (never the shipped ones)
            continue
        for part in pipeline.walk():
            used += by_class.get(type(part.component), [])
        used += by_class.get(type(build_protocol(model.get("protocol"))), [])
        used.append(("model.model", str(model.get("model"))))
        dataset = (config.get("data") or {}).get("dataset") or {}
        if isinstance(dataset, dict) and dataset.get("name"):
            used.append(("data.dataset", str(dataset["name"])))
        for key in dict.fromkeys(used):
            users.setdefault(key, []).append(preset)
    return users


def _markdown_text(doc: str) -> str:
    """A docstring's first paragraph as Markdown: Sphinx roles (``:class:`x <y>```) become code."""
    paragraph = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    return re.sub(r":[a-z]+:`(?:~)?([^`<]*?)(?:\s*<[^>]+>)?`", r"`\1`", paragraph)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no pipes)."""
    return text.replace("|", "or")


def reference_markdown() -> str:
    """The component reference as Markdown: a section per registry (:data:`ORDER` first), a
    subsection per component with its description, paper, capabilities, presets and parameters."""
    users = preset_users()
    registries = sorted(
        all_registries(), key=lambda r: (ORDER.index(r.field) if r.field in ORDER else len(ORDER), r.field)
    )
    lines = [
        "# Component reference",
        "",
        "Every registered component, generated from kvlab's registries (`kvlab list --format markdown`",
        "writes this page). A component is written in YAML as `{name: <name>, <parameter>: <value>}`",
        "at its registry's field; `docs/architecture.md` explains the fields and",
        "`docs/write_a_component.md` how to add one. *Capabilities* are what a component declares to",
        "the engine (`kvlab.config.capabilities.Capabilities`); *presets* are the shipped presets",
        "(`kvlab predict --config NAME`) that use it.",
        "",
    ]
    for registry in registries:
        lines += [f"## {plural(registry.kind).capitalize()}", "", f"YAML field: `{registry.field}`", ""]
        for row in registry.describe():
            cls = registry.get(row.name)
            lines += [
                f"### `{row.name}`",
                "",
                _markdown_text(cls.__doc__ or row.doc or "(no description)"),
                "",
            ]
            facts = []
            if row.paper is not None:
                facts.append(f"- **paper**: {row.paper}")
            if row.capabilities is not None:
                facts.append(f"- **capabilities**: {row.capabilities}")
            presets = users.get((registry.field, row.name))
            if presets:
                facts.append(f"- **presets**: {', '.join(f'`{p}`' for p in presets)}")
            lines += [*facts, ""] if facts else []
            if row.params:
                lines += ["| parameter | type | default |", "|---|---|---|"]
                lines += [f"| `{p}` | `{_cell(t)}` | `{_cell(d)}` |" for p, t, d in row.params]
                lines.append("")
    lines += ["## Presets", "", ", ".join(f"`{p}`" for p in preset_names()), ""]
    return "\n".join(lines)


def main(args: list[str]) -> None:
    """``kvlab list [--format text|markdown]``."""
    parser = argparse.ArgumentParser(prog="kvlab list", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--format",
        choices=("text", "markdown"),
        default="text",
        help="text (default): the registries for a terminal; markdown: the component reference",
    )
    ns = parser.parse_args(args)
    if ns.format == "markdown":
        print(reference_markdown())
    else:
        print_components()
