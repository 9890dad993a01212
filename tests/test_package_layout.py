"""The package's shape: folders by stage of the flow, imports that run one way, and an `attach` that reads as the flow.

Imports are read from the source with `ast`, not by importing: every `import` and `from ... import` of a
flash_catalog module counts wherever it stands (module level, inside a function, under `TYPE_CHECKING`), since a lazy
or type-only import is still a dependency a reader has to follow. An import of `pkg.mod` counts as an edge to
`pkg.mod` only, not to `pkg/__init__.py` as well (the stage folders' `__init__` modules import nothing).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import flash_catalog

PACKAGE = Path(flash_catalog.__file__).resolve().parent
MAX_ROOT_MODULES = 12
MAX_ATTACH_LINES = 40


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__.py`)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The flash_catalog modules `name` imports (the deepest module each import names)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
                    out.append(sorted(component))
    return out


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_twelve_modules_at_the_package_root():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_attach_reads_as_the_flow_in_at_most_forty_lines():
    lines = inspect.getsource(flash_catalog.attach).splitlines()
    assert len(lines) <= MAX_ATTACH_LINES, f"attach is {len(lines)} lines"
