"""`Snapshot`: proof, at C speed, that object graphs kept their structure."""

from __future__ import annotations

import gc
from collections.abc import Collection, Iterable, Iterator, Mapping, MutableMapping, MutableSequence
from itertools import chain
from operator import is_
from typing import Any

import jax
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.core import Tracer

from . import slots as _slots
from .pointers import same_objects


class Uncacheable(Exception):
    """A graph holds something whose changes cannot be seen cheaply."""


BOOKKEEPING = frozenset({"_pytree__state"})
"""Module attributes flax replaces on its own (its trace state), not structure."""

_metadata = nnx.Variable.get_metadata


def _children(tree: Any) -> tuple[Any, list[Any]]:
    """One level of a pytree: its treedef and its children."""
    children, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    return treedef, children


def _copies(dicts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of each dict, equal dicts sharing one (fewer objects to read on a check)."""
    shared: dict[Any, dict[str, Any]] = {}
    out = []
    for d in dicts:
        try:
            out.append(shared.setdefault(tuple(d.items()), dict(d)))
        except TypeError:  # an unhashable value: a copy of its own
            out.append(dict(d))
    return out


class Snapshot:
    """What a call's split depends on, below ``roots``: the identity of every value in
    every mutable container, every Variable's metadata, and the structure of pytrees
    that are not graph nodes (a ``register_dataclass`` instance held with ``nnx.data``).

    Raises `Uncacheable` for a graph whose changes it cannot see: one that holds a
    graph node type of its own.
    """

    def __init__(self, roots: Any):
        self._dicts: list[dict[Any, Any]] = []
        self._others: list[Any] = []
        self._pytrees: list[tuple[Any, Any, list[Any]]] = []
        self._variables: list[nnx.Variable[Any]] = []
        for path, obj in nnx.iter_graph(roots):
            if isinstance(obj, nnx.Variable):
                self._variables.append(obj)
            elif not nnx_graph.is_node(obj) or isinstance(obj, tuple):
                continue  # a leaf, or an immutable container: its parent holds it
            elif path and path[-1] in BOOKKEEPING:
                continue
            elif isinstance(obj, nnx.Pytree):
                self._dicts.append(vars(obj))
            elif type(obj) is dict:
                self._dicts.append(obj)
            elif isinstance(obj, nnx.State):  # its items wrap nested dicts anew on each read
                self._dicts.append(obj.raw_mapping)
            elif isinstance(obj, (MutableMapping, MutableSequence)):
                self._others.append(obj)
            elif nnx_graph.is_graph_node(obj):
                raise Uncacheable(type(obj).__name__)
            else:  # a pytree that is no graph node: its fields may be set in place
                self._pytrees.append((obj, *_children(obj)))
        # Each Variable's metadata, compared by value with a copy taken now: read as the
        # live dict (`slots`), else as flax's copy of it.
        self._read_metadata = _slots.metadata_dict if _slots.DIRECT else _metadata
        self._metadata = _copies(map(self._read_metadata, self._variables))
        self._keys, self._values = self._read()
        self._skip = frozenset(i for i, key in enumerate(self._keys) if key in BOOKKEEPING)
        self._arrays: frozenset[int] = frozenset()  # see `allow_arrays`
        self._refs = self._referents()

    def position(self, container: dict[Any, Any], key: Any) -> int | None:
        """The index among the checked values of ``container[key]``, where ``container``
        is one of the dicts this snapshot checks (a module's ``__dict__``, a dict)."""
        offset = 0
        for checked in self._dicts:
            if checked is container:
                return offset + list(checked).index(key) if key in checked else None
            offset += len(checked)
        return None

    def allow_arrays(self, positions: Collection[int]) -> None:
        """Lets the values at ``positions`` (graph leaves: plain array attributes) be
        replaced by any concrete ``jax.Array``: the graph keeps its structure, as flax
        flattens one array like another. The caller reads them anew on each call."""
        self._arrays = frozenset(positions)

    def wrote(self, position: int, value: Any) -> None:
        """Records that the caller stored ``value`` at ``position`` itself."""
        self._values[position] = value
        self._refs = None  # taken anew at the next check

    def _read(self) -> tuple[list[Any], list[Any]]:
        return self._read_keys(), [*self._iter_values()]

    def _read_keys(self) -> list[Any]:
        keys = [*chain.from_iterable(self._dicts)]
        for obj in self._others:
            keys += obj.keys() if isinstance(obj, Mapping) else range(len(obj))
        return keys

    def _iter_values(self) -> Iterator[Any]:
        values = chain.from_iterable(map(dict.values, self._dicts))
        if not self._others:
            return values
        rest = (obj.values() if isinstance(obj, Mapping) else obj for obj in self._others)
        return chain(values, chain.from_iterable(rest))

    def fresh(self) -> bool:
        """True when no container gained, lost or replaced a value, no Variable's
        metadata changed and no pytree changed its fields since the snapshot."""
        return self._containers_fresh() and self._leaves_fresh()

    def _leaves_fresh(self) -> bool:
        for obj, treedef, children in self._pytrees:
            now_treedef, now = _children(obj)
            if now_treedef != treedef or not all(map(is_, now, children)):
                return False
        try:  # equal metadata is the same graph definition (flax compares it so)
            return [*map(self._read_metadata, self._variables)] == self._metadata
        except Exception:  # noqa: BLE001 - a value whose == is not a bool (an array)
            return False

    def _containers_fresh(self) -> bool:
        keys = self._read_keys()  # strings and ints: equality is exact, identity quicker
        if not (same_objects(keys, self._keys) or keys == self._keys):
            return False
        # Every value's identity, in one step: the objects the dicts refer to, as the
        # garbage collector lists them (each dict's values, in its own order), against
        # those listed when last seen (`pointers`). Else the values in the dicts' order.
        if self._refs is not None and same_objects(gc.get_referents(*self._dicts), self._refs):
            return True
        values = [*self._iter_values()]
        if not same_objects(values, self._values):
            # Only flax's bookkeeping (a full call elsewhere replaced it) and arrays at
            # the positions of graph leaves (`allow_arrays`) may differ: then the
            # structure is the same; take the new values so the next check is quick.
            for i, (now, then) in enumerate(zip(values, self._values, strict=True)):
                if now is not then and not (
                    i in self._skip
                    or (
                        i in self._arrays
                        and isinstance(now, jax.Array)
                        and not isinstance(now, Tracer)
                    )
                ):
                    return False
            self._values = values
        self._refs = self._referents()
        return True

    def _referents(self) -> list[Any] | None:
        return None if self._others else gc.get_referents(*self._dicts)


class Structure:
    """Whether one graph kept its structure across a traced call.

    The quick `Snapshot` answers most of the time. When it sees a difference, the
    graph may still be the same: ``optimizer.update`` puts new ``nnx.State``
    containers around the same Variables, say. Then the graph definition and the
    Variables' identities decide (a trace-time check, so its cost does not matter).
    """

    def __init__(self, root: Any):
        self.snapshot = Snapshot((root,))
        self.root = root
        self.graphdef = nnx.graphdef(root)
        self.variables = _variable_ids(root)

    def fresh(self) -> bool:
        return self.snapshot.fresh() or (
            nnx.graphdef(self.root) == self.graphdef and _variable_ids(self.root) == self.variables
        )


def _variable_ids(root: Any) -> list[int]:
    return [id(x) for _, x in nnx.iter_graph(root) if isinstance(x, nnx.Variable)]
