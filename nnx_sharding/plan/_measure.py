"""Plans run for real on the devices present: their arguments made concrete, laid out
as each plan says, and their steps timed (`Plans.measure`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._nodes import is_node
from .._state_sharding import StateSharding
from ._plan import Plan
from ._step import Step


def time_steps(plan: Plan, step: Step, steps: int) -> float:
    """The median seconds of ``steps`` steps of ``plan`` run on the devices present, after
    one to compile, on arguments `materialise` makes (the caller's are not touched)."""
    mesh = plan.mesh()
    args = materialise(step, plan, mesh)
    fn = plan.jit(step.fun, mesh=mesh)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def materialise(step: Step, plan: Plan, mesh: Any) -> tuple[Any, ...]:
    """Concrete arguments laid out as ``plan`` says: the originals' values copied, or
    where they were abstract, small positive random floats (`_place`) and zero
    integers."""
    shardings = plan.shardings(mesh)
    originals = step.originals
    out = list(step.args)
    nodes = [i for i in step.variables]
    copies = nnx.eval_shape(lambda *a: a, *[originals[i] for i in nodes]) if nodes else ()
    for i, node in zip(nodes, copies, strict=True):
        entry = shardings[i]
        assert isinstance(entry, StateSharding)
        source = dict(nnx.to_flat_state(nnx.state(originals[i])))
        for path, var in nnx.to_flat_state(nnx.state(node)):
            value = source[path].get_value()
            var.set_value(_place(value, entry.sharding_for(path, var)))
        out[i] = node
    for i, arg in enumerate(originals):
        if i in step.static or is_node(arg) or i in step.variables:
            continue
        out[i] = jax.tree.map(
            lambda x, s: _place(x, s) if hasattr(x, "shape") else x,
            arg,
            shardings[i],
            is_leaf=lambda x: hasattr(x, "shape"),
        )
    return tuple(out)


def _place(value: Any, sharding: Any) -> Any:
    """``value`` on ``sharding``; an abstract float array as ``|N(0, 0.02²)|`` (not zeros,
    which a GPU multiplies faster, so that zeros would flatter `Plans.measure`: measured
    in docs/planning/predictions.md, "Measured on a GPU"; positive, so that a second
    moment stays one)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            data = jnp.zeros((*value.shape, 2), jnp.uint32)
            return jax.device_put(jax.random.wrap_key_data(data), sharding)
        if jnp.issubdtype(value.dtype, jnp.floating):
            key = jax.random.key(0)
            return jax.jit(
                lambda: jnp.abs(jax.random.normal(key, value.shape, value.dtype)) * 0.02,
                out_shardings=sharding,
            )()
        return jax.jit(lambda: jnp.zeros(value.shape, value.dtype), out_shardings=sharding)()
    if hasattr(value, "shape"):
        return jax.device_put(jnp.array(value, copy=True), sharding)
    return value
