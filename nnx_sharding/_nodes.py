"""Graph nodes and the paths to their Variables: the bottom layer of the package."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.core import Tracer

Path: TypeAlias = tuple[Any, ...]
"""An nnx path: the attribute names and indices from a graph node down to a Variable."""

NOT_NODES: set[type] = {tuple, list, dict, int, float, bool, complex, str, bytes, type(None)}
"""Types whose instances are never graph nodes; concrete array types join on first sight."""


def is_node(x: Any) -> bool:
    """flax's ``nnx.graph.is_graph_node``, answered from the type where it can be.

    flax's answer is slow for a non-node (it asks whether ``x`` is an array ref), and
    `jit` asks it of every argument on every call (measured: docs/performance.md, "Why
    the no-op step stays above 2× floor (b)").
    """
    kind = type(x)
    if kind in NOT_NODES:
        return False
    if nnx_graph.is_graph_node(x):
        return True
    if isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, Tracer):
        NOT_NODES.add(kind)  # a concrete array is never a ref: only tracers vary
    return False


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Variable`` (a leaf predicate for ``jax.tree`` walks)."""
    return isinstance(x, nnx.Variable)


def is_array(x: Any) -> bool:
    """Whether ``x`` has an array's ``shape`` and ``dtype``: an array, a tracer or a
    ``jax.ShapeDtypeStruct``."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def bound_node(fun: Any) -> Any:
    """The graph node ``fun`` is a bound method of, else None.

    A function, not an ``inspect.ismethod`` test at each caller: that test would narrow
    a caller's ``Callable[P, R]`` to a union with ``MethodType`` (``functools.wraps``
    then cannot solve its ParamSpec).
    """
    return fun.__self__ if inspect.ismethod(fun) and is_node(fun.__self__) else None


def alias_paths(node: Any, by_path: Mapping[Path, Any]) -> Iterator[tuple[Path, Any]]:
    """The second and later paths to each shared Variable inside ``node``."""
    for group in nnx.find_duplicates(node):
        first, *others = (tuple(p) for p in group)
        for path, value in by_path.items():
            if path[: len(first)] == first:
                for other in others:
                    yield other + path[len(first) :], value


def format_path(path: Path) -> str:
    """``('layers', 0, 'kernel')`` -> ``.layers[0].kernel`` (the keystr style)."""
    return "".join(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in path)
