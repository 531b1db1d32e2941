"""What differs between two graphs: inside `shard_map`, the inputs before and after the
function ran (by object identity); for a `Compiled`, the graphs it was compiled for and
those of a call (by path, type and value)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

from .. import _errors
from .._nodes import Path, format_path, is_array, is_node
from .outside import CallPlan


def graph_objects(plan: CallPlan, call_leaves: Sequence[Any]) -> dict[tuple[str, Path], Any]:
    """``(argument, path) -> object`` below each input graph node, shared objects under
    each of their paths: what a structure change is measured against (at trace time)."""
    found: dict[tuple[str, Path], Any] = {}
    for where, leaf in zip(plan.wheres, call_leaves, strict=True):
        if not is_node(leaf):
            continue
        objects = {
            tuple(path): obj
            for path, obj in nnx.iter_graph(leaf)
            if path and not str(path[-1]).startswith("_pytree__")
        }
        for first, *others in nnx.find_duplicates(leaf):
            if tuple(first) in objects:
                objects.update((tuple(other), objects[tuple(first)]) for other in others)
        found.update(((where, path), obj) for path, obj in objects.items())
    return found


def _kind(obj: Any) -> str:
    return "graph" if isinstance(obj, nnx.Variable) or is_node(obj) else "static"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if _kind(a) == "graph" or _kind(b) == "graph":
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array, say: not the same object, so changed
        return False


def graph_changes(
    before: dict[tuple[str, Path], Any], after: dict[tuple[str, Path], Any]
) -> dict[str, list[str]]:
    """Per argument, what the function added, removed or replaced in its graph: only
    the topmost change of each subtree, and of plain (static) values only those under a
    public name (not flax's bookkeeping such as ``_length``)."""
    found: list[tuple[str, tuple[str, Path], Any]] = []
    for key, obj in after.items():
        if key not in before:
            found.append(("added", key, obj))
        elif not _same(before[key], obj):
            found.append(("replaced" if _kind(before[key]) == "graph" else "changed", key, obj))
    found += [("removed", key, obj) for key, obj in before.items() if key not in after]
    keys = {key for _, key, _ in found}
    changes: dict[str, list[str]] = {}
    for kind, (where, path), obj in found:
        if any((where, path[:n]) in keys for n in range(1, len(path))):
            continue  # below a change already listed
        old = before.get((where, path), obj)
        if _kind(old) == _kind(obj) == "static" and str(path[-1]).startswith("_"):
            continue
        type_name = type(old).__name__ if kind != "changed" else ""
        changes.setdefault(where, []).append(
            _errors.graph_change(kind, where + format_path(path), type_name)
        )
    return changes


def _layout(node: Any) -> dict[Path, tuple[str, Any]]:
    """``path -> (type name, what else must match)`` for everything below ``node``, shared
    objects under each of their paths. What must match: a static attribute's value, a
    Variable's metadata; arrays (whose shapes are compared elsewhere) are all alike."""
    found: dict[Path, tuple[str, Any]] = {}
    for path, obj in nnx.iter_graph(node):
        if not path or any(str(k).startswith("_pytree__") for k in path):
            continue
        if isinstance(obj, nnx.Variable):
            found[tuple(path)] = (type(obj).__name__, obj.get_metadata())
        elif is_array(obj):
            found[tuple(path)] = ("array", None)
        else:
            found[tuple(path)] = (type(obj).__name__, None if is_node(obj) else obj)
    for group in nnx.find_duplicates(node):
        paths = [tuple(p) for p in group]
        listed = [p for p in paths if p in found]  # iter_graph gives one of them
        if not listed:
            continue
        first = listed[0]
        below = [(p[len(first) :], v) for p, v in found.items() if p[: len(first)] == first]
        found.update(((*o, *rest), v) for o in paths if o != first for rest, v in below)
    return found


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array, say: not comparable, so not equal
        return False


def _shared(node: Any) -> dict[Path, Path]:
    """``path -> the first path of the same object`` for the later paths of shared ones."""
    groups = (sorted(tuple(map(tuple, g))) for g in nnx.find_duplicates(node))
    return {other: first for first, *others in groups for other in others}


def _describe_sharing(where: str, first: Path | None) -> str:
    return "a separate object" if first is None else f"the object at {where}{format_path(first)}"


def compiled_differences(where: str, compiled: Any, called: Any) -> list[str]:
    """How the graph node ``called`` (the argument at ``where``) differs from ``compiled``,
    the one a program was compiled for (both with abstract or concrete leaves): every
    added, removed or changed attribute, the topmost of each subtree, then every shared
    reference that is shared in one only."""
    there, here = _layout(compiled), _layout(called)
    found: dict[Path, str] = {}
    for path in sorted(here.keys() | there.keys(), key=lambda p: (len(p), str(p))):
        if any(path[:n] in found for n in range(1, len(path))):
            continue  # below a difference already listed
        at = where + format_path(path)
        if path not in there:
            found[path] = _errors.compiled_difference(at, "added", here[path][0])
        elif path not in here:
            found[path] = _errors.compiled_difference(at, "removed", None, there[path][0])
        elif here[path][0] != there[path][0]:
            found[path] = _errors.compiled_difference(at, "type", here[path][0], there[path][0])
        elif not _equal(here[path][1], there[path][1]) and not str(path[-1]).startswith("_"):
            # (a name with "_" is flax's bookkeeping, a list's _length: its cause is listed)
            found[path] = _errors.compiled_difference(at, "value", here[path][1], there[path][1])
    messages = [found[p] for p in sorted(found, key=str)]
    shared_here, shared_there = _shared(called), _shared(compiled)
    for path in sorted(shared_here.keys() | shared_there.keys(), key=str):
        first_here, first_there = shared_here.get(path), shared_there.get(path)
        if first_here != first_there and path in here and path in there:
            messages.append(
                _errors.compiled_difference(
                    where + format_path(path),
                    "shared",
                    _describe_sharing(where, first_here),
                    _describe_sharing(where, first_there),
                )
            )
    return messages
