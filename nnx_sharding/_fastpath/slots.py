"""Direct access to a Variable's slots: the one place that touches flax internals.

Why: on the fast path (`snapshot`, `cache`) every call reads every Variable's metadata
and value, and writes the values the program changed. flax's public methods cost more
than jax's own dispatch for a large model: ``get_metadata()`` copies the dict, and
``set_raw_value`` checks the trace level on every write (measured: docs/performance.md,
"Why the no-op step stays above 2× floor (b)"). Here the snapshot compares each
Variable's live metadata dict with a copy (one C-level list comparison), values are read
and written through the slot, and flax's trace-level guarantee is kept by one check per
call (`cache.fast_call` compares jax's trace state with the one the split was cached at,
where the full path's writes were allowed).

The layout is probed once, at import (`_probe`): the metadata slot holds a plain dict
that ``get_metadata`` copies and ``set_metadata`` updates in place (by name) or replaces
(by dict); a write through the value slot is what ``get_raw_value`` reads back, and
``set_raw_value`` changes nothing else. If the probe fails, or ``NNX_SHARDING_PUBLIC_SLOTS=1``
is set, `DIRECT` is False and the public methods are used: everything works, only slower.
Variables that are ``ref``/``hijax`` (never cached), that override ``set_raw_value`` or
that carry value hooks are always written through ``set_raw_value`` (`setter`).

Plain array attributes (``self.w = jax.random.normal(...)``: graph leaves outside any
Variable) are stored by flax's merge with ``object.__setattr__`` (`attribute_writer` says
where that holds), so the fast path stores a new one the same way.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

from flax import nnx

_METADATA = "_var_metadata"
_VALUE = "_raw_value"
_HOOKS = ("on_set_value", "on_get_value")


def _slot(variable: nnx.Variable[Any], name: str) -> Any:
    return object.__getattribute__(variable, name)


def _probe() -> bool:
    """Whether flax's Variable keeps its metadata and value as this module expects."""
    try:
        variable: nnx.Variable[Any] = nnx.Variable(0.0)
        metadata = _slot(variable, _METADATA)
        if type(metadata) is not dict or metadata != variable.get_metadata():
            return False
        variable.set_metadata("probe", 1)  # by name: in place
        if _slot(variable, _METADATA) is not metadata or metadata.get("probe") != 1:
            return False
        variable.set_metadata({"probe": 2})  # a whole dict: a new one
        metadata = _slot(variable, _METADATA)
        if type(metadata) is not dict or metadata != variable.get_metadata():
            return False
        marker, other = object(), object()
        object.__setattr__(variable, _VALUE, marker)
        if variable.get_raw_value() is not marker:
            return False
        names = [n for n in nnx.Variable.__slots__ if n != _VALUE]
        before = [_slot(variable, n) for n in names]
        variable.set_raw_value(other)
        after = [_slot(variable, n) for n in names]
        return _slot(variable, _VALUE) is other and all(map(is_, before, after))
    except Exception:  # noqa: BLE001 - any other layout: use the public methods
        return False


DIRECT: bool = os.environ.get("NNX_SHARDING_PUBLIC_SLOTS") != "1" and _probe()
"""Whether the slots may be used; read when a snapshot or cache entry is made."""

metadata_dict: Callable[[nnx.Variable[Any]], dict[str, Any]] = attrgetter(_METADATA)
"""``variable -> its metadata dict`` (the live one: never write to it); only if `DIRECT`."""


def value_reader() -> Callable[[nnx.Variable[Any]], Any]:
    """``variable -> its raw value``: the slot if `DIRECT`, else ``get_raw_value``."""
    return attrgetter(_VALUE) if DIRECT else nnx.Variable.get_raw_value


def _plain(variable: nnx.Variable[Any]) -> bool:
    """Whether ``set_raw_value`` only stores the value (no override, hook, ref or hijax)."""
    return (
        DIRECT
        and type(variable).set_raw_value is nnx.Variable.set_raw_value
        and not any(hook in metadata_dict(variable) for hook in _HOOKS)
        and not variable.ref
        and not variable.hijax
    )


def setter(variable: nnx.Variable[Any]) -> Callable[[Any], None]:
    """``value -> None`` writing ``variable``'s raw value: through the slot if `DIRECT`
    and the Variable is a plain one, else through ``set_raw_value`` (which checks)."""
    if _plain(variable):
        return functools.partial(object.__setattr__, variable, _VALUE)
    return variable.set_raw_value


def attribute_writer(node: Any, key: Any) -> str | None:
    """The attribute under which flax's merge stores a graph leaf at ``key`` of ``node``
    with ``object.__setattr__``, or None where it does something else.

    flax's merge into an existing graph node clears it and sets each attribute again
    (``_graph_node_clear``, then ``_graph_node_init``: ``object.__setattr__`` per
    attribute, in the sorted order of its graph definition, which is the order a
    merged node has already). For a flax ``Pytree`` (a Module, ``nnx.List``,
    ``nnx.Dict``) whose two methods are flax's own, storing the new array under the
    attribute's name gives the same object. Other containers (a dict, a list) are
    pytrees to flax: its merge builds new ones, so None.
    """
    try:
        cls = type(node)
        if not isinstance(node, nnx.Pytree) or not all(
            getattr(cls, method) is getattr(nnx.Pytree, method)
            for method in ("_graph_node_clear", "_graph_node_init")
        ):
            return None
        name = key if isinstance(key, str) else str(key)
        return name if name in vars(node) else None
    except Exception:  # noqa: BLE001 - another layout of flax's Pytree: the full merge
        return None


def writer(variables: Sequence[nnx.Variable[Any]]) -> Callable[[Sequence[Any]], None]:
    """``values -> None`` writing ``values[i]`` to ``variables[i]``, as `setter` would:
    in one C-level pass through the slots when every Variable is plain, cheaper than a
    `setter` for each (measured: docs/performance.md, "Why the no-op step stays above 2×
    floor (b)")."""
    if all(map(_plain, variables)):
        targets = list(variables)

        def write_slots(values: Sequence[Any]) -> None:
            if len(values) != len(targets):
                raise ValueError(f"{len(values)} values for {len(targets)} Variables")
            deque(map(object.__setattr__, targets, repeat(_VALUE), values), 0)

        return write_slots
    setters = [setter(v) for v in variables]

    def write(values: Sequence[Any]) -> None:
        for set_value, value in zip(setters, values, strict=True):
            set_value(value)

    return write
