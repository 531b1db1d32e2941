"""Data parallelism with `shard_map`, alone and on a 2-D mesh with tensor parallelism."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._jit import jit
from .._shard_map import shard_map
from ._model import MLP, Array, Step, mse
from ._specs import AxisName, megatron_sharding, sharded_step
from ._tp_shard_map import tp_forward

Grads = nnx.State


def data_parallel_step(mesh: Mesh, axis: AxisName = "data") -> Step:
    """One adam step with the batch split over ``axis`` and the parameters replicated.

    Inside the `shard_map` each device differentiates the loss of its own slice of
    the batch, then the gradients are averaged with ``pmean``. The parameters are
    first cast to *varying* over ``axis`` (``jax.lax.pcast``): without it,
    ``check_vma`` makes the gradient of a replicated parameter the ``psum`` over the
    devices already, and the ``pmean`` would leave it ``n`` times too large. The
    optimizer update runs in the enclosing `jit`, replicated.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> step = data_parallel_step(make_mesh({'data': 1}))
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """

    @shard_map(mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P())
    def loss_and_grads(model: MLP, x: Array, y: Array) -> tuple[Array, Grads]:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.lax.pcast(params, axis, to="varying")  # this device's own copy

        def local_loss(params: nnx.State) -> Array:
            return mse(nnx.merge(graphdef, params, rest)(x), y)

        loss, grads = jax.value_and_grad(local_loss)(params)
        return jax.lax.pmean(loss, axis), jax.lax.pmean(grads, axis)

    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))

    @jit(in_shardings=(replicated, replicated, batch, batch), out_shardings=replicated)
    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: Array, y: Array) -> Array:
        loss, grads = loss_and_grads(model, x, y)
        optimizer.update(model, grads)
        return loss

    return step


def data_tensor_parallel_step(
    mesh: Mesh, data: AxisName = "data", model_axis: AxisName = "model"
) -> Step:
    """One adam step on a 2-D mesh: batch over ``data``, Megatron over ``model_axis``.

    Each ``data`` row of the mesh runs `tensor_parallel_step`'s forward pass on its
    slice of the batch; the per-slice losses are averaged with ``pmean`` over
    ``data``. The gradient is taken through the `shard_map`: jax transposes that
    ``pmean`` and the implicit broadcast of the parameters (replicated over
    ``data``) into the average of the per-slice gradients, and the ``psum`` over
    ``model_axis`` as in `tensor_parallel_step`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import make_mesh, make_optimizer
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> step = data_tensor_parallel_step(make_mesh({'data': 1, 'model': 1}))
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """
    specs = megatron_sharding(model_axis)

    @shard_map(mesh=mesh, in_specs=(specs, P(data), P(data)), out_specs=P())
    def loss_fn(model: MLP, x: Array, y: Array) -> Array:
        return jax.lax.pmean(mse(tp_forward(model, x, model_axis), y), data)

    return sharded_step(mesh, loss_fn, specs, P(data))
