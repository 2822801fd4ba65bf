"""User plugins: component modules that live outside kvlab and register into its registries.

A plugin is an ordinary Python module whose import registers components, e.g.
``@IMPORTANCE.register("my_scorer")`` on a dataclass. Two ways to load one, neither of which
edits kvlab:

- ``imports: [my_scorers, plugins/extra.py]`` at the top level of a YAML config: each entry is a
  module name (importable from the working directory or ``sys.path``) or a ``.py`` file path
  (relative to the config file that lists it; the loader makes it absolute). The modules
  are imported before the pipeline is built, so the same config can name their components.
  ``imports`` lists of a config and of the presets it inherits are concatenated.
- an installed distribution's entry point in the group ``kvlab.plugins``
  (``[project.entry-points."kvlab.plugins"] my_plugin = "my_package.components"``): loaded once
  per process, when the ``kvlab`` command starts and on the first registry lookup.

A module that cannot be found is a :class:`ConfigError` naming the ``imports`` field, raised
before any model loads. See ``docs/plugins.md``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from kvlab.config.errors import ConfigError

IMPORTS_KEY = "imports"
ENTRY_POINT_GROUP = "kvlab.plugins"

#: whether this process has loaded the ``kvlab.plugins`` entry points (set back to False to load
#: them again at the next registry lookup, e.g. after installing a plugin package)
entry_points_loaded = False


def is_file_reference(entry: str) -> bool:
    """Whether an ``imports`` entry names a ``.py`` file (otherwise it is a module name)."""
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def check_imports(node: Any, where: str = IMPORTS_KEY) -> list[str]:
    """The ``imports`` node as a list of strings (a single string is a one-element list)."""
    if node is None:
        return []
    if isinstance(node, str):
        node = [node]
    if not isinstance(node, list) or not all(isinstance(entry, str) and entry for entry in node):
        raise ConfigError(
            f"`{where}` must be a list of module names or .py file paths, e.g. "
            f"`{IMPORTS_KEY}: [my_scorers, plugins/extra.py]`; got {node!r}."
        )
    return list(node)


def resolve_imports(node: Any, relative_to: Path) -> list[str]:
    """The ``imports`` of a config file, with ``.py`` paths made absolute against its directory."""
    return [
        str((relative_to / entry).resolve()) if is_file_reference(entry) else entry
        for entry in check_imports(node)
    ]


def _loaded_from(path: Path) -> ModuleType | None:
    """A module already imported from ``path`` (under any name), or None."""
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and Path(origin).resolve() == path:
            return module
    return None


def _import_file(entry: str, search: list[Path]) -> ModuleType:
    path = Path(entry)
    candidates = [path] if path.is_absolute() else [d / path for d in search]
    found = next((p.resolve() for p in candidates if p.is_file()), None)
    if found is None or found.suffix != ".py":
        raise ConfigError(
            f"`{IMPORTS_KEY}` lists the file '{entry}', which does not exist or is not a .py file. A path "
            f"in `{IMPORTS_KEY}` is relative to the config file that lists it (then to the working "
            f"directory): fix it, or write a module name importable from the working directory, e.g. "
            f"`{IMPORTS_KEY}: [my_scorers]` for ./my_scorers.py."
        )
    module = _loaded_from(found)
    if module is not None:
        return module
    name = found.stem
    if name in sys.modules or not name.isidentifier():
        name = f"kvlab_plugin_{abs(hash(str(found)))}"
    spec = importlib.util.spec_from_file_location(name, found)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(entry: str, search: list[Path]) -> ModuleType:
    if entry in sys.modules:
        return sys.modules[entry]
    for directory in search:
        if str(directory) not in sys.path:
            sys.path.append(str(directory))
    try:
        spec = importlib.util.find_spec(entry)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None:
        raise ConfigError(
            f"`{IMPORTS_KEY}` lists the module '{entry}', which cannot be found: it is not importable from "
            f"the working directory ({Path.cwd()}) or sys.path. Fix the name, "
            f"run kvlab from the directory that holds {entry.replace('.', '/')}.py, install the package, "
            f"or write the module's .py path relative to the config file "
            f"(`{IMPORTS_KEY}: [path/to/{entry}.py]`)."
        )
    if spec.origin and spec.has_location:
        module = _loaded_from(Path(spec.origin).resolve())  # the same file loaded by path earlier
        if module is not None:
            return module
    return importlib.import_module(entry)


def import_plugins(entries: Iterable[str], relative_to: Path | None = None) -> list[ModuleType]:
    """Import each ``imports`` entry (module name or ``.py`` path); modules already imported are reused.

    Relative ``.py`` paths are looked up against ``relative_to`` (a config's directory) if given,
    then the working directory; module names on ``sys.path``, then in those directories.
    A missing module or file raises :class:`ConfigError`; an error inside a plugin propagates.
    """
    search = [d for d in (relative_to, Path.cwd()) if d is not None]
    modules = []
    for entry in check_imports(list(entries)):
        if is_file_reference(entry):
            modules.append(_import_file(entry, search))
        else:
            modules.append(_import_module(entry, search))
    return modules


def load_entry_points() -> list[str]:
    """Load every ``kvlab.plugins`` entry point once per process; returns the names loaded (now)."""
    global entry_points_loaded
    if entry_points_loaded:
        return []
    entry_points_loaded = True  # set first: a plugin that looks a component up does not recurse
    loaded = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except ImportError as exc:
            raise ConfigError(
                f"the installed kvlab plugin '{point.name}' (entry point {point.value!r} in the group "
                f"'{ENTRY_POINT_GROUP}') cannot be imported: {exc}. Reinstall or uninstall the package "
                "that declares it."
            ) from None
        loaded.append(point.name)
    return loaded
