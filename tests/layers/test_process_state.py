"""No process state: what a run sets belongs to the run, never to a module.

kvlab's modules may hold constants (tables, defaults) but no state that a run changes: a kernel
mode, a mask table or a flag written at module level outlives the run that wrote it and leaks
into the next one in the same process (a sweep, a test session, a notebook). The check reads
every module of ``kvlab/`` and ``kernels/`` (the ``kvlab.kernels`` package) as source:

- no ``global`` statement (a function that rebinds a module-level name);
- no module-level container (a dict, list or set display or comprehension, or a ``dict()``,
  ``list()``, ``set()``, ``Counter()``, ``defaultdict()``, ``OrderedDict()``, ``deque()`` call)
  is changed anywhere: no item assignment or deletion, no augmented assignment, no call of a
  mutating method (``append``, ``update``, ``clear``, ...), in its own module or through
  ``from module import NAME`` / ``module.NAME`` elsewhere.

State a run needs lives in the run: an object's attribute, the session, or a
:class:`contextvars.ContextVar` set for the run's extent (the kernel mode, the running command).
:data:`ALLOWED` lists the few module-level names that are process-wide by nature, each with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO

#: (file, name) -> why this module-level state is process-wide by nature
ALLOWED = {
    ("kvlab/config/registry.py", "REGISTRIES"): "every Registry enrols itself once, when its module is "
    "imported, as modules enrol in sys.modules; `kvlab list` walks it",
    ("kernels/dispatch.py", "CALLS"): "a diagnostic counter of which path each kernel call took; only "
    "added to, never read to decide anything",
    ("kvlab/metrics/tasks.py", "TASK_METRICS"): "task metrics register once, when their suite's module is "
    "imported (a registry, like REGISTRIES)",
    ("kvlab/metrics/tasks.py", "SAMPLE_CHECKS"): "registered with TASK_METRICS, once, at import",
    ("kvlab/bench/__init__.py", "BENCHES"): "`kvlab bench` commands register once, at import (a registry)",
    ("kvlab/config/plugins.py", "entry_points_loaded"): "installed plugins' entry points are imported once "
    "per process, as sys.modules imports a module once; set before loading so a plugin that looks a "
    "component up does not recurse",
}
CONTAINER_CALLS = {"dict", "list", "set", "Counter", "defaultdict", "OrderedDict", "deque"}
MUTATORS = {
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
    "add", "discard", "sort", "reverse", "appendleft", "extendleft", "subtract",
}  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One piece of module-level state that changes: where it is defined and where it changes."""

    file: str
    name: str
    where: str

    def message(self) -> str:
        return (
            f"{self.file}: `{self.name}` is module-level state that changes ({self.where}): keep it in the "
            "run (an object's attribute, the session, a ContextVar set for the run), or add it to ALLOWED "
            "with the reason it is process-wide"
        )


def module_name(path: Path, root: Path) -> str:
    """``kvlab/engine/masking.py`` -> ``kvlab.engine.masking``; ``kernels/x.py`` -> ``kvlab.kernels.x``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["kvlab", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in CONTAINER_CALLS
    return False


def module_containers(tree: ast.Module) -> set[str]:
    """Names bound to mutable containers at module level."""
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []  # fmt: skip
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if is_container(value):
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def changes(tree: ast.Module) -> Iterator[tuple[int, ast.expr]]:
    """``(line, changed expression)`` for every item assignment or deletion, augmented assignment and
    mutating method call in ``tree`` (the expression is what changes: ``X`` in ``X[k] = v``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            yield node.lineno, node.value
        elif isinstance(node, ast.AugAssign):
            yield node.lineno, node.target
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            yield node.lineno, node.func.value


@dataclass
class Scope:
    """The module-level containers one module reaches: its own, those it imports by name
    (``from m import X``) and those of the modules it imports (``import m as a``: ``a.X``)."""

    names: dict[str, tuple[str, str]]
    modules: dict[str, str]
    containers: dict[str, set[str]]

    def owner(self, expr: ast.expr) -> tuple[str, str] | None:
        """``(file, name)`` of the container ``expr`` is, or None."""
        if isinstance(expr, ast.Name):
            return self.names.get(expr.id)
        if (
            isinstance(expr, ast.Attribute)
            and isinstance(expr.value, ast.Name)
            and expr.value.id in self.modules
        ):
            source = self.modules[expr.value.id]
            return (source, expr.attr) if expr.attr in self.containers[source] else None
        return None


def scope_of(file: str, tree: ast.Module, modules: dict[str, str], containers: dict[str, set[str]]) -> Scope:
    names = {name: (file, name) for name in containers[file]}
    aliases: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            source = modules[node.module]
            for alias in node.names:
                if alias.name in containers[source]:
                    names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = modules[alias.name]
    return Scope(names, aliases, containers)


def find_process_state(files: dict[str, str]) -> list[Finding]:
    """The findings over ``files`` (``{"kvlab/engine/x.py": source}``), as the module docstring says."""
    trees = {file: ast.parse(source) for file, source in files.items()}
    modules = {module_name(Path(file), Path(".")): file for file in files}
    containers = {file: module_containers(tree) for file, tree in trees.items()}
    findings = []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                findings += [
                    Finding(file, name, f"rebound by `global` at line {node.lineno}") for name in node.names
                ]
        scope = scope_of(file, tree, modules, containers)
        for line, expr in changes(tree):
            target = scope.owner(expr)
            if target is not None:
                findings.append(Finding(target[0], target[1], f"changed at {file}:{line}"))
    return [f for f in dict.fromkeys(findings) if (f.file, f.name) not in ALLOWED]


def test_no_module_level_state_changes_in_kvlab() -> None:
    files = {
        str(path.relative_to(REPO)): path.read_text()
        for folder in ("kvlab", "kernels")
        for path in sorted((REPO / folder).rglob("*.py"))
        if not path.is_symlink()
        and not any(p.is_symlink() for p in path.relative_to(REPO).parents if str(p) != ".")
    }
    findings = find_process_state(files)
    assert not findings, "\n".join(f.message() for f in findings)


def test_allowed_state_still_exists_and_is_explained() -> None:
    """Every ALLOWED entry names a module-level name that is there (a stale entry would hide a new
    one of the same name) and says why."""
    for (file, name), reason in ALLOWED.items():
        tree = ast.parse((REPO / file).read_text())
        bound = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Name)}  # fmt: skip
        assert name in bound, f"ALLOWED names {file}: {name}, which is no longer bound at module level"
        assert len(reason) > 40


def test_the_check_finds_each_kind_of_change() -> None:
    """The checker itself: a global rebinding, a mutated table in its module and one changed through
    an import are each found; constants and a ContextVar pass."""
    files = {
        "kvlab/a.py": (
            "from contextvars import ContextVar\n"
            "TABLE = {'x': 1}\nMODE: ContextVar[str] = ContextVar('m', default='auto')\nSEEN = []\n"
            "FLAG = False\n\n"
            "def f():\n    global FLAG\n    FLAG = True\n    MODE.set('x')\n    return TABLE['x']\n"
        ),
        "kvlab/b.py": "from kvlab.a import SEEN\nimport kvlab.a as a\n\ndef g():\n    SEEN.append(1)\n",
        "kvlab/c.py": "import kvlab.a as a\n\ndef h():\n    a.TABLE['y'] = 2\n",
    }
    found = {(f.file, f.name, f.where.split(" at ")[0]) for f in find_process_state(files)}
    assert found == {
        ("kvlab/a.py", "FLAG", "rebound by `global`"),
        ("kvlab/a.py", "SEEN", "changed"),
        ("kvlab/a.py", "TABLE", "changed"),
    }
