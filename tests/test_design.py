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


def page_layers(text: str) -> dict[str, tuple[int, int]]:
    """Each module the page lists -> its layer, as ``(layer, group)``: ``### 4.`` is
    ``(4, 0)``, a group ``#### 4.2`` inside it ``(4, 2)``, above the layer's others."""
    layers: dict[str, tuple[int, int]] = {}
    layer = (-1, 0)
    for line in text.splitlines():
        if m := re.match(r"### (\d+)\. ", line):
            layer = (int(m.group(1)), 0)
        elif m := re.match(r"#### (\d+)\.(\d+) ", line):
            layer = (int(m.group(1)), int(m.group(2)))
        elif m := re.match(r"\| `([\w/]+\.py)` \|", line):
            layers[m.group(1)] = layer
    return layers


def test_every_module_is_on_the_page_and_nothing_else() -> None:
    listed = set(page_layers(PAGE.read_text()))
    assert sorted(modules() - listed) == [], "modules missing from docs/design.md"
    assert sorted(listed - modules()) == [], "docs/design.md names modules that do not exist"


def test_imports_go_down_the_layers() -> None:
    layers = page_layers(PAGE.read_text())

    def layer(module: str) -> tuple[int, int]:
        parts = module.split(".")[1:]
        path = "/".join(parts) + ".py"
        return layers.get(path, layers.get("/".join([*parts, "__init__.py"]), (-1, 0)))

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


def test_a_group_is_above_its_layer_and_below_the_next() -> None:
    page = "### 5. Top\n| `c.py` | c |\n### 4. Mid\n| `a.py` | a |\n#### 4.1 G\n| `b.py` | b |\n"
    layers = page_layers(page)
    assert layers["a.py"] < layers["b.py"] < layers["c.py"]


def test_folders_are_small_and_their_names_distinct(package: Path = PACKAGE) -> None:
    """At most 8 modules directly in ``plan/`` (its groups are folders), and no two
    modules of one folder whose names differ only by a suffix (``_plan``, ``_plans``,
    ``_planner``)."""
    crowded, alike = [], []
    for folder in sorted({p.parent for p in package.rglob("*.py")}):
        names = sorted(p.stem.lstrip("_") for p in folder.glob("*.py") if p.stem != "__init__")
        if folder == package / "plan" and len(names) + 1 > 8:
            crowded.append(f"{folder.relative_to(package)}: {len(names) + 1} modules")
        alike += [
            f"{folder.relative_to(package)}: {a} and {b}"
            for a, b in zip(names, names[1:], strict=False)
            if b.startswith(a) and b[len(a) :] in ("s", "er", "ers", "ing", "ed")
        ]
    assert crowded == []
    assert alike == []


def test_modules_in_private_folders_are_unprefixed(package: Path = PACKAGE) -> None:
    """Inside a private folder (``_errors/``, ``plan/_search/``) every module is private
    already, and its name carries no underscore; inside a public one (``plan/``) only the
    public modules are unprefixed."""
    wrong = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.stem != "__init__"
        and any(part.startswith("_") for part in p.parent.relative_to(package).parts)
        and p.stem.startswith("_")
    ]
    assert wrong == []
