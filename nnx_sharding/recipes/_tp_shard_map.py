"""Tensor parallelism, Megatron style, written with `shard_map`: one ``psum`` by hand."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._shard_map import shard_map
from ._model import MLP, Array, Step, mse
from ._specs import AxisName, megatron_sharding, sharded_step


def tp_forward(model: MLP, x: Array, axis: AxisName | None = "model") -> Array:
    """The MLP's forward pass on one device's Megatron shards (inside a shard_map).

    ``up`` computes this device's hidden units; ``down``'s rows for those units give
    a partial sum of the output, summed over ``axis`` *before* the (replicated)
    bias is added. With ``axis=None`` it is the plain forward pass.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((4, 2))
    >>> bool(jnp.allclose(tp_forward(model, x, axis=None), model(x)))
    True
    """
    if axis is None:
        return model(x)
    hidden = nnx.relu(model.up(x))  # (batch, hidden / n): this device's columns
    partial = hidden @ model.down.kernel[...]  # (batch, dout): this device's share
    bias = model.down.bias
    assert bias is not None
    return jax.lax.psum(partial, axis) + bias[...]


def tensor_parallel_step(mesh: Mesh, axis: AxisName = "model") -> Step:
    """One adam step of the MLP, tensor-parallel over ``axis`` with `shard_map`.

    The loss is a `shard_map` over `megatron_sharding` (the batch replicated) and
    holds the one collective, the ``psum`` of `tp_forward`. The gradient is taken
    *through* the shard_map: jax transposes the ``psum`` (``check_vma``), so each
    device gets the exact gradient of its own shards. The optimizer update runs in
    the enclosing `jit`, whose ``in_shardings`` keep parameters and adam's moments
    in the Megatron layout.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> mesh = make_mesh({'model': 1})
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> step = tensor_parallel_step(mesh)
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """
    specs = megatron_sharding(axis)

    @shard_map(mesh=mesh, in_specs=(specs, P(), P()), out_specs=P())
    def loss_fn(model: MLP, x: Array, y: Array) -> Array:
        return mse(tp_forward(model, x, axis), y)

    return sharded_step(mesh, loss_fn, specs)
