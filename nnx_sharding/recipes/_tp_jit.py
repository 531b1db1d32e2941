"""Tensor parallelism through `jit` shardings alone: the compiler adds the collectives."""

from __future__ import annotations

from jax.sharding import Mesh

from ._model import Step, mse
from ._specs import AxisName, megatron_sharding, sharded_step


def jit_tensor_parallel_step(mesh: Mesh, axis: AxisName = "model") -> Step:
    """The step of `reference_step`, laid out by `megatron_sharding` through `jit`.

    The body is the plain flax step: no shard_map, no collective. The parameters
    and adam's moments come in (and go out: `jit` constrains updated Variables to
    their in-sharding) in the Megatron layout; XLA's sharding propagation splits the
    matmuls to match and inserts the all-reduce that `tensor_parallel_step` writes
    by hand.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from nnx_sharding.recipes import MLP, make_mesh, make_optimizer
    >>> model = MLP(2, 8, 3, rngs=nnx.Rngs(0))
    >>> step = jit_tensor_parallel_step(make_mesh({'model': 1}))
    >>> step(model, make_optimizer(model), jnp.ones((4, 2)), jnp.ones((4, 3))).shape
    ()
    """
    return sharded_step(mesh, lambda m, x, y: mse(m(x), y), megatron_sharding(axis))
