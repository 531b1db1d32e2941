"""A pytree of graph nodes as what orbax saves: its arrays by Variable path, and a JSON
description of them (the Variable types, and the logical dtype of PRNG keys).

The arrays are the whole ``nnx.state(tree)`` (a shared Variable once, at its first
path), as a nested dict keyed by the path's parts as strings. Typed PRNG keys
(``nnx.Rngs``' ``RngKey``) are saved as they are: orbax 0.12 stores their key data and
the key implementation, and restores a key of the target's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.core import Tracer
from jax.tree_util import keystr

from .. import _errors
from .._nodes import Path, format_path, is_node

Tree: TypeAlias = Any
"""A pytree of graph nodes: a Module, ``(model, optimizer)``, a dict of them, ..."""
Key: TypeAlias = tuple[str, ...]
"""A Variable's path as stored: every part a string (orbax names arrays by them)."""
Nested: TypeAlias = dict[str, Any]
"""A nested dict keyed by the parts of `Key`\\ s: what orbax saves and restores
(``orbax.checkpoint.tree.from_flat_dict`` of ``{key: leaf}``; ``to_flat_dict`` back)."""
Json: TypeAlias = dict[str, Any]
"""The JSON item saved beside the arrays."""

FORMAT = "nnx_sharding.checkpoint"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Entry:
    """One saved Variable as the JSON item describes it.

    >>> Entry((0, 'kernel'), 'Param', (2, 3), 'float32').key
    ('0', 'kernel')
    """

    path: Path
    type: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def key(self) -> Key:
        return stored_key(self.path)


def stored_key(path: Path) -> Key:
    """The path as orbax stores it, each part a string; orbax joins the parts with '.'
    (and names files by them), so '.', '/' and '%' inside a part are escaped: two paths
    are never stored under one name (a container's keys are all ints or all strings).

    >>> stored_key(('opt_state', 0, 'mu'))
    ('opt_state', '0', 'mu')
    >>> stored_key(('a.b',))
    ('a%2Eb',)
    """
    return tuple(
        str(part).replace("%", "%25").replace(".", "%2E").replace("/", "%2F") for part in path
    )


def where(argument: str, path: Path) -> str:
    """``argument`` and the Variable path in the keystr style: ``target[0].up.kernel``.

    >>> where('target', (0, 'up', 'kernel'))
    'target[0].up.kernel'
    """
    return f"{argument}{format_path(path)}"


def variables(transform: str, argument: str, tree: Tree) -> list[tuple[Path, nnx.Variable]]:
    """``(path, Variable)`` for each Variable of ``nnx.state(tree)``, in nnx's order.

    Every leaf of the pytree ``tree`` must be a graph node; each problem is listed.
    """
    keyed = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]
    problems = [
        ("node", _errors.not_a_node_problem(f"{argument}{keystr(kp)}", type(leaf).__name__))
        for kp, leaf in keyed
        if not is_node(leaf)
    ]
    if isinstance(tree, nnx.Variable):  # no path of its own: nnx.state fails on it
        problems.append(("variable", _errors.bare_variable_problem(argument, type(tree).__name__)))
    found = [] if problems else nnx.to_flat_state(nnx.state(tree))
    if not problems and not found:
        problems.append(("empty", _errors.no_variables_problem(argument)))
    problems += [
        (
            "outside",
            _errors.array_outside_variable_problem(
                where(argument, tuple(path)), type(leaf).__name__
            ),
        )
        for path, leaf in found
        if not isinstance(leaf, nnx.Variable)
    ]
    if problems:
        raise TypeError(_errors.not_savable(transform, argument, problems))
    return [(tuple(path), var) for path, var in found]


def value_problem(var: nnx.Variable, value: Any, restoring: bool) -> str:
    """What is wrong with ``value``, ``var``'s value, to save (or, ``restoring``, to
    restore into: abstract and deleted arrays are fine, they are replaced): a kind for
    `_errors.value_problem`, or ``''``."""
    if var.ref:
        return "ref"
    if isinstance(value, jax.ShapeDtypeStruct):
        return "" if restoring else "abstract"
    if isinstance(value, Tracer):
        return "tracer"
    if isinstance(value, jax.Array):
        return "deleted" if value.is_deleted() and not restoring else ""
    return "" if isinstance(value, (np.ndarray, np.generic)) else "other"


def check_values(
    transform: str, argument: str, found: Sequence[tuple[Path, nnx.Variable]], restoring: bool
) -> None:
    """Every Variable holds an array (`value_problem`); each problem is listed."""
    problems = []
    for path, var in found:
        value = var.get_raw_value()
        if kind := value_problem(var, value, restoring):
            text = _errors.value_problem(
                kind, type(var).__name__, where(argument, path), type(value).__name__
            )
            problems.append((kind, text))
    if problems:
        raise TypeError(_errors.not_savable(transform, argument, problems))


def savable(transform: str, tree: Tree) -> tuple[Nested, Json]:
    """The arrays of ``tree`` as a nested dict by stored path, and their JSON description.

    >>> from flax import nnx
    >>> arrays, described = savable('save', nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> sorted(arrays), described['variables'][1]
    (['bias', 'kernel'], {'path': ['kernel'], 'type': 'Param', 'shape': [2, 3], 'dtype': 'float32'})
    """
    found = variables(transform, "tree", tree)
    check_values(transform, "tree", found, restoring=False)
    entries = [
        Entry(path, type(var).__name__, tuple(value.shape), str(value.dtype))
        for path, var in found
        for value in [var.get_raw_value()]
    ]
    arrays = ocp.tree.from_flat_dict({stored_key(p): var.get_raw_value() for p, var in found})
    return arrays, to_json(entries)


def to_json(entries: Iterable[Entry]) -> Json:
    return {
        "format": FORMAT,
        "version": VERSION,
        "variables": [
            {
                "path": [p if isinstance(p, (int, str)) else str(p) for p in e.path],
                "type": e.type,
                "shape": list(e.shape),
                "dtype": e.dtype,
            }
            for e in entries
        ],
    }


def from_json(data: Any) -> dict[Key, Entry] | None:
    """The entries of a JSON item by stored key; None if it is not one of ours."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        return None
    return {
        entry.key: entry
        for item in data.get("variables", [])
        for entry in [Entry(tuple(item["path"]), item["type"], tuple(item["shape"]), item["dtype"])]
    }
