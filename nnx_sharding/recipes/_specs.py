"""Shardings shared by the recipes: the Megatron split, path filters, binding to a mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._jit import jit
from .._state_sharding import StateSharding
from .._types import ShardingLike
from ._model import MLP, Array, Step

AxisName: TypeAlias = str
PathParts: TypeAlias = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class PathEndsWith:
    """nnx filter: the Variable's path ends with ``suffix``.

    It matches a parameter (``('up', 'kernel')``) and the optimizer state that mirrors
    it (``('opt_state', 0, 'mu', 'up', 'kernel')``) alike.

    >>> PathEndsWith(('up', 'kernel'))(('opt_state', 0, 'mu', 'up', 'kernel'), None)
    True
    """

    suffix: PathParts

    def __call__(self, path: PathParts, value: Any) -> bool:
        return tuple(path[len(path) - len(self.suffix) :]) == self.suffix


def megatron_sharding(axis: AxisName = "model") -> StateSharding:
    """Megatron's tensor-parallel MLP: ``up`` split by columns, ``down`` by rows.

    ``up.kernel`` is ``P(None, axis)`` and ``up.bias`` ``P(axis)``: each device holds
    whole hidden units. ``down.kernel`` is ``P(axis, None)``: each device's hidden
    units give a partial sum of the output, added up by one ``psum``. The rest
    (``down.bias``, counters) is replicated. The filters match paths, so the same
    StateSharding shards an optimizer's state like the parameters.

    >>> megatron_sharding().sharding_for(('opt_state', 0, 'mu', 'up', 'kernel'), None)
    P(None, 'model')
    """
    return StateSharding(
        {
            PathEndsWith(("up", "kernel")): P(None, axis),
            PathEndsWith(("up", "bias")): P(axis),
            PathEndsWith(("down", "kernel")): P(axis, None),
            ...: P(),
        }
    )


def on_mesh(mesh: Mesh, sharding: StateSharding) -> StateSharding:
    """The same filters with each PartitionSpec made a ``NamedSharding`` on ``mesh``.

    A jitted step given these needs no ``jax.set_mesh`` around its calls.

    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> on_mesh(mesh, megatron_sharding()).shardings[0].spec
    P(None, 'model')
    """
    return StateSharding(
        [
            (f, NamedSharding(mesh, s) if isinstance(s, P) else s)
            for f, s in zip(sharding.filters, sharding.shardings, strict=True)
        ]
    )


LossFn: TypeAlias = Callable[[MLP, Array, Array], Array]
"""``loss_fn(model, x, y) -> loss``."""


def sharded_step(
    mesh: Mesh, loss_fn: LossFn, params: StateSharding, batch: P | None = None
) -> Step:
    """The jitted adam step the recipes share: ``value_and_grad(loss_fn)``, then
    ``optimizer.update``. Parameters and optimizer state are laid out by ``params``,
    ``x`` and ``y`` by ``batch`` (replicated if None), the loss comes back replicated.
    """
    shardings = on_mesh(mesh, params)
    replicated = NamedSharding(mesh, P())
    batched = replicated if batch is None else NamedSharding(mesh, batch)

    @jit(in_shardings=(shardings, shardings, batched, batched), out_shardings=replicated)
    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return step


def make_mesh(axes: Mapping[AxisName, int]) -> Mesh:
    """``jax.make_mesh`` with ``AxisType.Auto`` axes, from ``{'data': 2, 'model': 4}``.

    >>> make_mesh({'data': 1, 'model': 1}).axis_types
    (Auto, Auto)
    """
    names = tuple(axes)
    return jax.make_mesh(tuple(axes.values()), names, axis_types=(AxisType.Auto,) * len(names))


def as_spec(sharding: ShardingLike) -> P:
    """The PartitionSpec of a StateSharding value (None: replicated)."""
    if sharding is None:
        return P()
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, P):
        return sharding
    raise TypeError(f"expected a PartitionSpec or NamedSharding, got {sharding!r}")


def spec_dim(spec: P, axis: AxisName) -> int | None:
    """The dimension ``spec`` splits over ``axis`` (None if it does not use it)."""
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            return dim
    return None
