"""kvlab's layers (docs/architecture.md, "Layers"): the import contract holds, no module imports
itself back through others, and imports inside functions are only those of optional dependencies.

Imports are read from the source (every ``import`` statement, inside functions and
``TYPE_CHECKING`` blocks included), so an import hidden in a function still counts.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.paths import REPO

# package name -> folder (kvlab.kernels and kvlab.configs live outside kvlab/, pyproject's package-dir)
SOURCES = {"kvlab": REPO / "kvlab", "kvlab.kernels": REPO / "kernels"}


def source_modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every kvlab module (packages by their ``__init__``)."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[ast.stmt, str, bool]]:
    """``(node, imported module, inside a function)`` for every import statement of a module."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    nested = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, id(node) in nested
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node, base, id(node) in nested
            for alias in node.names:  # `from package import submodule`
                yield node, f"{base}.{alias.name}", id(node) in nested


def import_graph() -> dict[str, set[str]]:
    """``{module: kvlab modules it imports}`` (an import of ``a.b.c`` is an import of that module)."""
    modules = source_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for _, imported, _ in _imports(tree, name, path.name == "__init__.py"):
            if imported in modules and imported != name:
                graph[name].add(imported)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (each one an import cycle), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_kvlab_module_imports_itself_back():
    cycles = strongly_connected(import_graph())
    assert not cycles, "import cycles between kvlab modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_strongly_connected_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_kernels_import_only_the_ground_and_themselves():
    graph = import_graph()
    stray = {
        (name, imported)
        for name, targets in graph.items()
        if name.startswith("kvlab.kernels")
        for imported in targets
        if not imported.startswith(("kvlab.kernels", "kvlab.config"))
    }
    assert not stray, f"kvlab.kernels imports above the ground: {sorted(stray)}"


def _functions(tree: ast.AST) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _explained(lines: list[str], node: ast.stmt, function: ast.AST, dependency: str) -> bool:
    """A comment on the import's own lines, or one naming ``dependency`` earlier in its function."""
    own = lines[node.lineno - 1 : node.end_lineno]
    if any("#" in line for line in own):
        return True
    earlier = lines[function.lineno - 1 : node.lineno - 1]
    return any("#" in line and dependency in line.split("#", 1)[1].lower() for line in earlier)


def test_imports_inside_functions_are_optional_dependencies_named_in_a_comment():
    """Inside a function: a third-party or platform module (optional, slow to import, missing on
    some systems) with a comment saying why, or a Triton launcher (``kvlab.kernels.tl``, which
    needs triton) with a comment naming triton; never another kvlab module, which would hide a
    layer's dependency."""
    offenders = []
    for name, path in source_modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), filename=str(path))
        innermost = {}
        for function in _functions(tree):
            for child in ast.walk(function):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    innermost[id(child)] = function  # ast.walk visits outer functions first
        for node, imported, inside in _imports(tree, name, path.name == "__init__.py"):
            if not inside or isinstance(node, ast.ImportFrom) and imported != (node.module or imported):
                continue  # module-level, or the `from x import name` duplicate of an ImportFrom
            launcher = imported.startswith("kvlab.kernels.tl")
            dependency = "triton" if launcher else imported.split(".")[0]
            if imported.startswith("kvlab") and not launcher:
                allowed = False
            else:
                allowed = _explained(lines, node, innermost[id(node)], dependency)
            if not allowed:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {imported}")
    assert not offenders, "imports inside functions without an optional dependency's reason:\n" + "\n".join(
        offenders
    )


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_linter_contract_holds():
    result = subprocess.run(
        ["lint-imports", "--config", str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def component_modules() -> set[str]:
    """The modules of ``kvlab.compression`` that register a component (a class decorated with a
    registry's ``register``)."""
    found = set()
    for name, path in source_modules().items():
        if not name.startswith("kvlab.compression."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "register"
                for d in node.decorator_list
            ):
                found.add(name)
    return found


def test_the_runner_imports_no_component_module():
    """A record's fields come from the components' own reports (``Pipeline.report``), so the runner
    knows no method: it imports no module that registers a component (``kvlab.compression.context``
    and the like stay allowed)."""
    components = component_modules()
    assert {"kvlab.compression.routing", "kvlab.compression.retrieval"} <= components
    stray = sorted(
        (name, imported)
        for name, targets in import_graph().items()
        if name.startswith("kvlab.runner")
        for imported in targets
        if imported in components
    )
    assert not stray, f"the runner imports component modules: {stray}"
