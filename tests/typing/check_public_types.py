"""Static checks of the public API's types, read by pyright (`nox -s typecheck`).

Nothing runs at import: each check is a function that pyright reads. A
``typing.assert_type`` (or an assignment to a declared type, for the ParamSpec of
a wrapper, which keeps the parameter names) makes pyright fail should the types
the public API gives a caller drift; a call that must be rejected carries a
``pyright: ignore``, which is itself an error once it is no longer needed.
"""

# pyright: reportUnnecessaryTypeIgnoreComment=true

from __future__ import annotations

from typing import Any, assert_type

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import Sharding

import nnx_sharding
from nnx_sharding import Compiled, JitWrapped, Lowered, ShardMapFn, Traced


def jit_decorator(model: nnx.Linear, x: jax.Array) -> None:
    @nnx_sharding.jit
    def forward(model: nnx.Linear, x: jax.Array) -> jax.Array:
        return model(x)

    wrapped: JitWrapped[[nnx.Linear, jax.Array], jax.Array] = forward
    assert_type(wrapped(model, x), jax.Array)
    assert_type(forward(model, x), jax.Array)
    assert_type(forward(model, x=x), jax.Array)
    assert_type(forward.trace(model, x), Traced)
    assert_type(forward.lower(model, x), Lowered)
    assert_type(forward.lower(model, x).compile(), Compiled)
    forward(model)  # pyright: ignore[reportCallIssue] - the ParamSpec keeps the signature
    forward(x, model)  # pyright: ignore[reportArgumentType] - and the parameter types


def jit_factory(model: nnx.Linear, x: jax.Array) -> None:
    @nnx_sharding.jit(in_shardings=(nnx_sharding.StateSharding({...: P()}), P()))
    def loss(model: nnx.Linear, x: jax.Array, scale: float = 1.0) -> tuple[jax.Array, int]:
        return model(x).sum() * scale, 0

    wrapped: JitWrapped[[nnx.Linear, jax.Array, float], tuple[jax.Array, int]] = loss
    assert_type(wrapped(model, x, 2.0), tuple[jax.Array, int])
    assert_type(loss(model, x), tuple[jax.Array, int])
    assert_type(loss(model, x, scale=2.0), tuple[jax.Array, int])


def jit_call() -> None:
    def double(x: jax.Array) -> jax.Array:
        return 2 * x

    wrapped: JitWrapped[[jax.Array], jax.Array] = nnx_sharding.jit(double)
    assert_type(nnx_sharding.jit(double)(jnp.ones(2)), jax.Array)
    assert_type(wrapped.eval_shape(jnp.ones(2)), Any)


def shard_map_decorator(model: nnx.Linear, x: jax.Array) -> None:
    @nnx_sharding.shard_map(in_specs=(P(), P("data")), out_specs=P("data"))
    def forward(model: nnx.Linear, x: jax.Array) -> jax.Array:
        return model(x)

    wrapped: ShardMapFn[[nnx.Linear, jax.Array], jax.Array] = forward
    assert_type(wrapped(model, x), jax.Array)
    assert_type(forward(model, x), jax.Array)
    assert_type(forward.lower(model, x), Lowered)
    forward(model)  # pyright: ignore[reportCallIssue] - the ParamSpec keeps the signature


def shard_map_call() -> None:
    def body(x: jax.Array) -> jax.Array:
        return x

    wrapped: ShardMapFn[[jax.Array], jax.Array] = nnx_sharding.shard_map(
        body, in_specs=P("data"), out_specs=P("data")
    )
    assert_type(wrapped(jnp.ones(8)), jax.Array)


def state_sharding() -> None:
    ours = nnx_sharding.StateSharding({nnx.Param: P(None, "model"), ...: None})
    assert_type(ours.shardings, tuple[Sharding | P | None, ...])
    assert_type(ours.sharding_for(("kernel",), nnx.Param(1.0)), Sharding | P | None)
    # flax's own StateSharding is accepted wherever ours is
    flax_sharding = nnx.StateSharding({nnx.Param: P(None, "model"), ...: None})
    nnx_sharding.jit(lambda m: m, in_shardings=(flax_sharding,))


def exported(e: nnx_sharding.Exported) -> None:
    assert_type(e.nr_devices, int)
    assert_type(e.platforms, tuple[str, ...])
    assert_type(e.fun_name, str)
    assert_type(e.call(), tuple[Any, tuple[nnx.State[Any, Any], ...]])


def planner(plans: nnx_sharding.plan.Plans, model: nnx.Linear, x: jax.Array) -> None:
    from nnx_sharding.plan import Plan

    assert_type(plans.best, Plan)
    assert_type(plans[0], Plan)
    assert_type(plans[1:], list[Plan])

    def forward(model: nnx.Linear, x: jax.Array) -> jax.Array:
        return model(x)

    wrapped: JitWrapped[[nnx.Linear, jax.Array], jax.Array] = plans.best.jit(forward)
    assert_type(plans.best.jit(forward)(model, x), jax.Array)
    assert_type(wrapped(model, x), jax.Array)
    plans.best.jit(forward)(x)  # pyright: ignore[reportCallIssue] - the ParamSpec is kept


def shard(model: nnx.Linear, mesh: jax.sharding.Mesh) -> None:
    assert_type(nnx_sharding.shard(model, mesh), nnx.Linear)
    assert_type(nnx_sharding.shard(model, shardings=mesh, rules=[("embed", None)]), nnx.Linear)
    assert_type(nnx_sharding.shard(model, mesh=mesh), nnx.Linear)  # the deprecated name
    nnx_sharding.shard(model, mesh=P())  # pyright: ignore[reportArgumentType] - a Mesh or None
