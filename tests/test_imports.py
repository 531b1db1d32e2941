"""The package's modules import one another in one direction only: no cycles.

Every ``import`` and ``from ... import`` of a module inside ``nnx_sharding`` counts,
those inside functions too (a deferred import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nnx_sharding"


def _name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = {_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in modules else base)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, each as the modules along it."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    assert [" -> ".join(c) for c in cycles(import_graph())] == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "nnx_sharding"
    package.mkdir()
    (package / "__init__.py").write_text("from ._a import f\n")
    (package / "_a.py").write_text("from . import _errors\n\ndef f():\n    from ._b import g\n")
    (package / "_b.py").write_text("from ._a import f as g\n")
    (package / "_errors.py").write_text("")
    graph = import_graph(package)
    assert graph == {
        "nnx_sharding": {"nnx_sharding._a"},
        "nnx_sharding._a": {"nnx_sharding._errors", "nnx_sharding._b"},
        "nnx_sharding._b": {"nnx_sharding._a"},
        "nnx_sharding._errors": set(),
    }
    assert cycles(graph) == [["nnx_sharding._a", "nnx_sharding._b", "nnx_sharding._a"]]


def imported_names(package: Path = PACKAGE) -> list[tuple[str, int, str, str]]:
    """Every ``from <module of the package> import name`` of a name (not a module):
    (importing module, line, source module, name)."""
    modules = {_name(p, package): p for p in package.rglob("*.py")}
    out = []
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if base not in modules:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" not in modules:
                    out.append((name, node.lineno, base, alias.name))
    return out


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (not those it imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under a version test
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    for target in sub.targets:
                        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_no_private_name_crosses_modules() -> None:
    """What a sibling needs is a name without the underscore in the module that owns it."""
    crossing = [
        f"{module}:{line} imports {name} from {source}"
        for module, line, source, name in imported_names()
        if name.startswith("_") and not name.startswith("__")
    ]
    assert crossing == []


def test_each_name_comes_from_its_defining_module() -> None:
    """``from .x import y`` only where ``x`` defines ``y`` (the package's ``__init__``
    files, which re-export the public surface, are the exception)."""
    paths = {_name(p, PACKAGE): p for p in PACKAGE.rglob("*.py")}
    relayed = [
        f"{module}:{line} imports {name} from {source}, which does not define it"
        for module, line, source, name in imported_names()
        if name != "*"
        and paths[source].name != "__init__.py"
        and name not in defined_names(paths[source])
    ]
    assert relayed == []
