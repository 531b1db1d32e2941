"""``docs/design.md`` is the package's map: every module listed, none that is gone, and
the layers it states are the ones the imports follow."""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import PACKAGE, import_graph

PAGE = PACKAGE.parent / "docs" / "design.md"


def modules(package: Path = PACKAGE) -> set[str]:
    """Every module of the package as a path below it (``plan/_cost.py``)."""
    return {p.relative_to(package).as_posix() for p in package.rglob("*.py")}


def page_layers(text: str) -> dict[str, int]:
    """Each module the page lists -> the number of the layer it is listed under."""
    layers: dict[str, int] = {}
    layer = -1
    for line in text.splitlines():
        if m := re.match(r"### (\d+)\. ", line):
            layer = int(m.group(1))
        elif m := re.match(r"\| `([\w/]+\.py)` \|", line):
            layers[m.group(1)] = layer
    return layers


def test_every_module_is_on_the_page_and_nothing_else() -> None:
    listed = set(page_layers(PAGE.read_text()))
    assert sorted(modules() - listed) == [], "modules missing from docs/design.md"
    assert sorted(listed - modules()) == [], "docs/design.md names modules that do not exist"


def test_imports_go_down_the_layers() -> None:
    layers = page_layers(PAGE.read_text())

    def layer(module: str) -> int:
        parts = module.split(".")[1:]
        path = "/".join(parts) + ".py"
        return layers.get(path, layers.get("/".join([*parts, "__init__.py"]), -1))

    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in import_graph().items()
        for b in targets
        if layer(b) > layer(a)
    ]
    assert upward == []


def test_a_missing_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("")
    page = "### 1. One\n\n| module | owns |\n|---|---|\n| `a.py` | a |\n| `gone.py` | x |\n"
    assert modules(tmp_path) - set(page_layers(page)) == {"sub/b.py"}
    assert set(page_layers(page)) - modules(tmp_path) == {"gone.py"}
