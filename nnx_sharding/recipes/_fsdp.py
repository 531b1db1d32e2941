"""Fully sharded data parallelism (FSDP) with `shard_map`: parameters gathered per step."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._shard_map import shard_map
from .._state_sharding import StateSharding
from ._model import MLP, Array, Step, mse
from ._specs import AxisName, PathEndsWith, as_spec, sharded_step, spec_dim
from ._tp_shard_map import tp_forward

M = TypeVar("M", bound=nnx.Module)


def fsdp_sharding(
    model: nnx.Module, mesh: Mesh, axis: AxisName = "data", base: StateSharding | None = None
) -> StateSharding:
    """Each parameter split over ``axis`` on its first free dimension that ``axis`` divides.

    ``base`` (e.g. `megatron_sharding`) gives the other axes' split, and the FSDP
    axis goes on the first dimension it leaves free; a parameter with no such
    dimension stays replicated over ``axis``. One `PathEndsWith` filter per
    parameter, so adam's moments are split alike; everything else is replicated.

    >>> from flax import nnx
    >>> from nnx_sharding.recipes import MLP, make_mesh
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> fsdp_sharding(model, make_mesh({'data': 1})).sharding_for(('up', 'kernel'), None)
    P('data',)
    """
    size = mesh.shape[axis]
    rules: list[tuple[PathEndsWith, P]] = []
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = param[...].shape
        spec = tuple(as_spec(base.sharding_for(path, param))) if base is not None else ()
        spec += (None,) * (len(shape) - len(spec))
        pairs = enumerate(zip(spec, shape, strict=True))
        free = [d for d, (entry, n) in pairs if entry is None and n % size == 0]
        if free:
            spec = spec[: free[0]] + (axis,) + spec[free[0] + 1 :]
        while spec and spec[-1] is None:
            spec = spec[:-1]
        rules.append((PathEndsWith(tuple(path)), P(*spec)))
    return StateSharding([*rules, (..., P())])


def gather_params(model: M, sharding: StateSharding, axis: AxisName) -> M:
    """A new module holding ``model``'s Variables ``all_gather``-ed over ``axis``.

    Call it inside a shard_map. ``model`` itself is left alone (its Variables keep
    their shards); the gradient of a gathered parameter comes back to its shard
    through ``all_gather``'s transpose, a ``psum_scatter`` (a reduce-scatter).
    """
    graphdef, state = nnx.split(model)

    def gather(path: tuple[Any, ...], variable: nnx.Variable[Any]) -> nnx.Variable[Any]:
        dim = spec_dim(as_spec(sharding.sharding_for(path, variable)), axis)
        if dim is None:
            return variable
        return variable.replace(jax.lax.all_gather(variable[...], axis, axis=dim, tiled=True))

    return nnx.merge(graphdef, nnx.map_state(gather, state))


def fsdp_step(
    mesh: Mesh, sharding: StateSharding, data: AxisName = "data", model_axis: AxisName | None = None
) -> Step:
    """One adam step with FSDP over ``data`` (and tensor parallelism over ``model_axis``).

    Parameters and adam's moments live split by ``sharding`` (see `fsdp_sharding`);
    the batch is split over ``data``. Each step the `shard_map`'d loss gathers the
    parameters over ``data``, runs `tp_forward` on its slice of the batch (a
    ``psum`` over ``model_axis`` if given) and averages the loss with ``pmean``. The
    gradient, taken through the shard_map, is reduce-scattered back onto the shards;
    the optimizer update in the enclosing `jit` touches only the local shards.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> model, mesh = MLP(2, 8, 3, rngs=nnx.Rngs(0)), make_mesh({'data': 1})
    >>> step = fsdp_step(mesh, fsdp_sharding(model, mesh))
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """

    @shard_map(mesh=mesh, in_specs=(sharding, P(data), P(data)), out_specs=P())
    def loss_fn(model: MLP, x: Array, y: Array) -> Array:
        full = gather_params(model, sharding, data)
        return jax.lax.pmean(mse(tp_forward(full, x, model_axis), y), data)

    return sharded_step(mesh, loss_fn, sharding, P(data))
