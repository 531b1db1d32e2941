"""`Snapshot`: proof, at C speed, that object graphs kept their structure."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, MutableSequence
from itertools import chain
from operator import is_
from typing import Any

from flax import nnx
from flax.nnx import graph as nnx_graph


class Uncacheable(Exception):
    """A graph holds a mutable container whose changes cannot be seen cheaply."""


BOOKKEEPING = frozenset({"_pytree__state"})
"""Module attributes flax replaces on its own (its trace state), not structure."""


class Snapshot:
    """Identity of every value in every mutable container below ``roots``."""

    def __init__(self, roots: Any):
        self._dicts: list[dict[Any, Any]] = []
        self._others: list[Any] = []
        for _, obj in nnx.iter_graph(roots):
            if isinstance(obj, nnx.Variable) or not nnx_graph.is_node(obj):
                continue
            if isinstance(obj, nnx.Pytree):
                self._dicts.append(vars(obj))
            elif type(obj) is dict:
                self._dicts.append(obj)
            elif isinstance(obj, nnx.State):  # its items wrap nested dicts anew on each read
                self._dicts.append(obj.raw_mapping)
            elif isinstance(obj, (MutableMapping, MutableSequence)):
                self._others.append(obj)
            elif nnx_graph.is_graph_node(obj):
                raise Uncacheable(type(obj).__name__)
        self._keys, self._values = self._read()
        self._skip = [i for i, key in enumerate(self._keys) if key in BOOKKEEPING]

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
        """True when no container gained, lost or replaced a value since the snapshot."""
        if self._read_keys() != self._keys:
            return False
        if all(map(is_, self._iter_values(), self._values)):  # streamed: no list built
            return True
        # Only flax's bookkeeping may differ (a full call elsewhere replaced it): then
        # the structure is the same; take the new bookkeeping so the next check is quick.
        values = [*self._iter_values()]
        new = [values[i] for i in self._skip]
        for i in self._skip:
            values[i] = self._values[i]
        if not all(map(is_, values, self._values)):
            return False
        for i, value in zip(self._skip, new, strict=True):
            self._values[i] = value
        return True


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
