"""The package layout tree of docs/architecture.md is the package layout on disk.

The tree is the fenced block of docs/architecture.md that starts with ``kvlab/``: one entry per
line (``name.py`` or ``name/``, two spaces of indent per level, several names joined by ", "),
its description after it, continued on the deeper-indented lines below. The rules:

1. Every entry of the tree exists.
2. Every module (a ``.py`` file other than ``__init__.py``) and every package (a folder with an
   ``__init__.py``) under kvlab/ and kernels/ is in the tree: as an entry of its own, or, in a
   folder the tree shows without its contents (``runner/views/``), named in that folder's
   description as ``name.py`` or ``name/`` (its direct children: the tree goes no deeper there).
   Every ``name.py`` or ``name/`` such a description names exists in that folder.
3. Every entry has a description.
4. Every package's ``__init__.py`` has a docstring, and every kvlab module or name its Sphinx roles
   point to (``:mod:`kvlab.cli.main```, ``:class:`~.inspector.Inspector```, relative to the
   package) exists: the module's file, then the name defined at the module's top level.

kvlab/kernels and kvlab/configs are links to kernels/ and configs/ in a development checkout;
the tree shows those folders at the top, and ``kvlab.kernels.*`` resolves to kernels/.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from support.paths import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
#: the folders whose Python files the tree must show (kvlab/configs holds presets, not code)
CODE_ROOTS = ("kvlab", "kernels")
#: an entry line: indent, then one or more names (``api.py``, ``views/``), then the description
ENTRY = re.compile(r"(?P<indent> *)(?P<names>[\w.]+(?:\.py|/)(?:, [\w.]+(?:\.py|/))*)(?: +(?P<text>.*))?")
#: a file or folder a description names: ``name.py`` or ``name/``, not part of a longer path
NAMED = re.compile(r"(?<![\w./])(\w+\.py|\w+/)(?![\w.])")
#: a Sphinx role's target in a docstring: ``:mod:`kvlab.cli.main```, ``:class:`~.inspector.Inspector```
ROLE = re.compile(r":\w+:`~?(\.?[\w.]+)`")


@dataclass
class Entry:
    """One entry of the tree: its path from the repository root (a folder ends with "/")."""

    path: str
    text: str
    line: int
    children: list[str] = field(default_factory=list)

    @property
    def collapsed(self) -> bool:
        """A folder the tree shows without its contents (its description names them)."""
        return self.path.endswith("/") and not self.children


def layout_tree() -> dict[str, Entry]:
    """The entries of docs/architecture.md's layout tree by path."""
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("kvlab/") and lines[i - 1].startswith("```")
    )
    entries: dict[str, Entry] = {}
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders enclosing the current line
    last: list[Entry] = []  # the entries of the last entry line (continuation lines extend them)
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("```"):
            break
        match = ENTRY.fullmatch(line)
        indent = len(line) - len(line.lstrip(" "))
        if match is None or indent > (folders[-1][0] + 2 if folders else 0):
            for entry in last:  # a continuation line of the last entry's description
                entry.text = f"{entry.text} {line.strip()}".strip()
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        last = []
        for name in match["names"].split(", "):
            entry = entries[parent + name] = Entry(parent + name, match["text"] or "", number)
            last.append(entry)
            if parent:
                entries[parent].children.append(entry.path)
            if name.endswith("/"):
                folders.append((indent, entry.path))
    return entries


def code_on_disk() -> tuple[list[str], list[str]]:
    """(modules, packages) under kvlab/ and kernels/, as paths from the repository root; links
    (kvlab/kernels, kvlab/configs) are not followed."""
    modules, packages = [], []
    for root in CODE_ROOTS:
        for folder, subfolders, files in os.walk(REPO / root):
            subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
            relative = Path(folder).relative_to(REPO).as_posix()
            if "__init__.py" in files:
                packages.append(f"{relative}/")
            modules += [f"{relative}/{f}" for f in sorted(files) if f.endswith(".py") and f != "__init__.py"]
    return modules, packages


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] + "/"


def _base(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[1] + ("/" if path.endswith("/") else "")


def test_every_entry_of_the_tree_exists() -> None:
    entries = layout_tree()
    assert "kvlab/api.py" in entries and "kvlab/runner/views/" in entries  # the parser reads the tree
    stale = [f"{e.path} (line {e.line})" for e in entries.values() if not (REPO / e.path).exists()]
    for folder in (e for e in entries.values() if e.collapsed):
        stale += [
            f"{folder.path}{name} (named in {folder.path}'s description, line {folder.line})"
            for name in NAMED.findall(folder.text)
            if not (REPO / folder.path / name).exists()
        ]
    assert not stale, "remove from the layout tree in docs/architecture.md (not on disk): " + ", ".join(stale)


def test_every_module_and_package_is_in_the_tree() -> None:
    entries = layout_tree()
    modules, packages = code_on_disk()
    missing = []
    for path in sorted(modules + packages):
        folder = entries.get(_parent(path))
        if path in entries or folder is None:  # listed, or deeper than the tree goes (checked as its folder)
            continue
        if not folder.collapsed:
            missing.append(f"{path} (an entry under {folder.path}, line {folder.line})")
        elif _base(path) not in NAMED.findall(folder.text):
            where = f"the description of {folder.path}, line {folder.line}"
            missing.append(f"{path} (name `{_base(path)}` in {where})")
    assert not missing, "add to the layout tree in docs/architecture.md: " + "; ".join(missing)


def test_every_entry_has_a_description() -> None:
    bare = [f"{e.path} (line {e.line})" for e in layout_tree().values() if not e.text.strip()]
    assert not bare, "describe in docs/architecture.md's layout tree: " + ", ".join(bare)


def _module_file(parts: list[str]) -> Path | None:
    """The file of module ``kvlab.<parts>`` (a package's ``__init__.py``), or None."""
    base = REPO / "kvlab"
    if parts[:1] in (["kernels"], ["configs"]):  # kvlab.kernels is kernels/ (installed under kvlab)
        base, parts = REPO / parts[0], parts[1:]
    path = base.joinpath(*parts)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if parts and path.with_suffix(".py").is_file() else None


def _top_level_names(source: Path) -> set[str]:
    """The names a module defines or imports at its top level (and lists in ``__all__``)."""
    names: set[str] = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value:
                names.update(ast.literal_eval(node.value))
    return names


def _unresolved(target: str, package: list[str]) -> str | None:
    """Why a role's target (``kvlab.a.b.Name`` or ``.b.Name`` within ``package``) does not
    exist, or None when it does; a target outside kvlab (``RunMetrics``, ``torch.Tensor``) is not
    checked."""
    if target.startswith("."):
        parts = package + target[1:].split(".")
    elif target.startswith("kvlab."):
        parts = target.split(".")[1:]
    else:
        return None
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = _module_file(parts[:cut])
        if module is not None:
            rest = parts[cut:]
            if rest and rest[0] not in _top_level_names(module):
                where = ".".join(["kvlab", *parts[:cut]])
                return f"there is no module {where}.{rest[0]} and {where} defines no {rest[0]!r}"
            return None
    return f"there is no module kvlab.{'.'.join(parts)}"


def test_every_package_docstring_exists_and_names_what_exists() -> None:
    _, packages = code_on_disk()
    problems = []
    for package in packages:
        init = REPO / package / "__init__.py"
        parts = package.rstrip("/").split("/")
        parts = parts[1:] if parts[0] == "kvlab" else parts  # kernels/tl/ is kvlab.kernels.tl
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        if not docstring:
            problems.append(f"{package}__init__.py has no docstring: describe the package there")
            continue
        for target in ROLE.findall(docstring):
            why = _unresolved(target, parts)
            if why:
                problems.append(f"{package}__init__.py names `{target}`: {why}; correct or remove it")
    assert not problems, "\n".join(problems)
