"""Hardening (issue 8), item 2, nothing lost: a call that raises leaves the caller's
graphs exactly as they were.

The call raises while tracing, after the function returned, at run time, while staging,
or is a `Compiled` called wrongly or failing at run time. `TRANSFORMS` lists the
transforms these tests run over: `jit` and `shard_map` (replicating everything over
`MESH`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hardening_common import (
    MESH,
    XX,
    Boom,
    assert_same_values,
    assert_unchanged,
    clone,
    forward,
    named,
    record,
    variables_of,
)
from jax.sharding import PartitionSpec as P

import nnx_sharding
from nnx_sharding import StateSharding


class Tower(nnx.Module):
    """Every kind of graph edge: a shared submodule (in a List and as an attribute), a
    Variable under two paths, an nnx.Dict, a counter and a static attribute."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.shared = nnx.Linear(4, 4, rngs=rngs)
        self.blocks = nnx.List([self.shared, nnx.Linear(4, 4, rngs=rngs)])
        self.tied = self.shared.kernel
        self.table = nnx.Dict(scale=nnx.Param(jnp.full(4, 0.5)), steps=nnx.BatchStat(jnp.array(0)))
        self.name = "tower"

    def __call__(self, x):
        self.table["steps"][...] += 1
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return x * self.table["scale"][...]


def wreck(model: Tower) -> None:
    """Changes every kind of thing a failing call must not leave behind."""
    model.tied[...] += 1.0
    model.table["scale"][...] = jnp.zeros(4)
    model.blocks.append(nnx.Linear(4, 4, rngs=nnx.Rngs(9)))
    model.shared = nnx.Linear(4, 4, rngs=nnx.Rngs(8))
    model.extra = nnx.Param(jnp.ones(()))
    del model.table["steps"]
    model.name = "wrecked"


def replicated_shard_map(fun, *, static_argnames=(), **options):
    """`nnx_sharding.shard_map` over ``MESH``, every argument and output replicated.

    ``jax.shard_map`` (and so `shard_map`) takes no static arguments: the keyword
    arguments named in ``static_argnames`` are bound with ``functools.partial``, one
    `ShardMapFn` per value, each kept for the calls that follow.
    """
    options = {"mesh": MESH, "in_specs": P(), "out_specs": P(), **options}
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if not names:
        return nnx_sharding.shard_map(fun, **options)
    mapped: dict[tuple, nnx_sharding.ShardMapFn] = {}

    def call(*args, **kwargs):
        static = tuple((k, kwargs.pop(k)) for k in names if k in kwargs)
        if static not in mapped:
            mapped[static] = nnx_sharding.shard_map(
                functools.partial(fun, **dict(static)), **options
            )
        return mapped[static](*args, **kwargs)

    return call


TRANSFORMS = [  # factories ``(fun, **options) -> callable``
    pytest.param(nnx_sharding.jit, id="jit"),
    pytest.param(replicated_shard_map, id="shard_map"),
]


def fail_if_negative(value):
    if float(value) < 0:
        raise Boom("negative input at run time")


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("warm_calls", [0, 2], ids=["first_call", "after_fast_calls"])
@pytest.mark.parametrize("trigger", ["static_flag", "new_shape"])
def test_trace_time_error_leaves_graphs_unchanged(transform, warm_calls, trigger):
    """The function updates values, changes structure, then raises while being traced."""

    def step(model, other, x, fail=False):
        y = model(x)
        other.kernel[...] += 1.0
        if fail or x.shape[0] == 3:
            wreck(model)
            other.extra = nnx.Param(jnp.zeros(2))
            raise Boom("bad call")
        return y

    model, other = Tower(), nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    ref_model, ref_other = clone(model), clone(other)
    f = transform(step, static_argnames="fail")
    for _ in range(warm_calls):
        f(model, other, XX)
        step(ref_model, ref_other, XX)
    before = record(model, other)
    with pytest.raises(Boom, match="bad call"):
        if trigger == "static_flag":
            f(model, other, XX, fail=True)
        else:
            f(model, other, jnp.ones((3, 4)))
    assert_unchanged(before, model, other)
    # and the next call runs as usual
    np.testing.assert_allclose(f(model, other, XX), step(ref_model, ref_other, XX), 1e-6, 1e-6)
    assert_same_values(model, ref_model)
    assert_same_values(other, ref_other)


AFTER_RETURN = {  # per transform: (options, the message of the error it raises)
    nnx_sharding.jit: [
        (
            dict(
                in_shardings=StateSharding({nnx.Param: named("model"), ...: None}),
                out_shardings=StateSharding({nnx.Param: named(), ...: None}),
            ),
            r"jit: in_shardings/out_shardings: ",  # an in/out sharding conflict
        ),
        (dict(out_shardings=(None, None)), r"jit: out_shardings: is not a pytree prefix"),
    ],
    replicated_shard_map: [
        (
            {},  # the structure change itself, each of wreck's changes named
            re.escape(
                "shard_map: arguments: the function changed the graph structure of args[0] "
                "(added a Linear at args[0].blocks[2]; added a Param at args[0].extra; changed "
                "the attribute args[0].name; replaced the Linear at args[0].shared by another "
                "object; removed the BatchStat at args[0].table.steps)\n"
            ),
        ),
        (dict(out_specs=(P(), P())), r"shard_map: out_specs: is not a pytree prefix"),
    ],
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("error", [0, 1], ids=["own_rule", "out_not_a_prefix"])
def test_error_raised_after_the_function_returned_leaves_graphs_unchanged(transform, error):
    """The package's own error, raised while splitting the outputs (jit: an in/out
    sharding conflict; shard_map: the structure change itself; both: an output prefix
    that does not fit), comes after the function changed everything."""

    def step(model):
        wreck(model)
        return model

    options, pattern = AFTER_RETURN[transform][error]
    model = Tower()
    f = transform(step, **options)
    before = record(model)
    with pytest.raises(ValueError, match=pattern):
        f(model)
    assert_unchanged(before, model)


def _runtime_step(model, x):
    y = model(x)
    model.tied[...] += 1.0
    jax.debug.callback(fail_if_negative, x.min())
    return y


def sharded_jit(fun, **options):
    """`jit` of a program on all 8 devices of ``MESH`` (every argument replicated)."""
    return nnx_sharding.jit(fun, in_shardings=named(), **options)


RUN_TIME_TRANSFORMS = [
    pytest.param(nnx_sharding.jit, id="jit"),
    # Programs on several devices run asynchronously: the call waits for them only
    # because they have a host callback (`cache.PlanState.wait`).
    pytest.param(sharded_jit, id="jit_on_8_devices"),
    pytest.param(replicated_shard_map, id="shard_map"),
]


def _no_op_callback(x):
    jax.debug.callback(lambda: None)
    return x


@pytest.fixture
def settle_run_time_errors():
    """After the test, clears a run-time error jax still holds: a failed program's runtime
    token stays, and every later ``jax.effects_barrier()`` (another test's, or jax's at
    exit) raises it again, until an effectful program runs on those devices."""
    yield
    jax.jit(jax.shard_map(_no_op_callback, mesh=MESH, in_specs=P(), out_specs=P()))(XX)
    jax.effects_barrier()


@pytest.mark.usefixtures("settle_run_time_errors")
@pytest.mark.parametrize("transform", RUN_TIME_TRANSFORMS)
@pytest.mark.parametrize("warm_calls", [0, 2], ids=["first_call", "after_fast_calls"])
def test_run_time_error_leaves_graphs_unchanged(transform, warm_calls):
    model = Tower()
    ref = clone(model)
    f = transform(_runtime_step)
    for _ in range(warm_calls):
        f(model, XX + 2.0)
        _runtime_step(ref, XX + 2.0)
    before = record(model)
    with pytest.raises(jax.errors.JaxRuntimeError, match="negative input at run time"):
        f(model, XX)
        jax.effects_barrier()
    assert_unchanged(before, model)
    np.testing.assert_allclose(f(model, XX + 2.0), _runtime_step(ref, XX + 2.0), 1e-6, 1e-6)
    assert_same_values(model, ref)


@pytest.mark.usefixtures("settle_run_time_errors")
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("warm_calls", [0, 2], ids=["first_call", "after_fast_calls"])
def test_run_time_error_with_donation_loses_the_donated_values(transform, warm_calls):
    """The documented exception to "nothing lost" (`jit`'s docstring, donate_argnums).

    Donated buffers are consumed when the program starts, so after a run-time error the
    donated Variables hold deleted arrays, as with raw ``jax.jit``; this cannot be undone
    after the fact. The graph keeps its structure and objects, and the next call names
    the deleted Variables instead of failing somewhere inside jax.
    """
    if transform is replicated_shard_map:
        pytest.skip(
            "shard_map has no donate_argnums/donate_argnames (nor has jax.shard_map): it "
            "never donates, so a failed run consumes no buffer and the run-time test without "
            "donation is the whole story"
        )
    model = Tower()
    f = transform(_runtime_step, donate_argnums=0)
    for _ in range(warm_calls):
        f(model, XX + 2.0)
    before = record(model)
    with pytest.raises(jax.errors.JaxRuntimeError, match="negative input at run time"):
        f(model, XX)
        jax.effects_barrier()
    assert nnx.graphdef(model) == before["graphdefs"][0], "structure changed"
    objects = [
        (0, path, id(obj))
        for path, obj in nnx.iter_graph(model)
        if isinstance(obj, (nnx.Pytree, nnx.Variable))
    ]
    assert objects == before["objects"], "graph objects replaced, added or removed"
    assert all(v.get_raw_value().is_deleted() for v in variables_of(model)), "values kept"
    with pytest.raises(RuntimeError, match=r"args\[0\]\.\S+ has been deleted"):
        f(model, XX + 2.0)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("method", ["trace", "lower", "eval_shape"])
def test_error_while_staging_leaves_graphs_unchanged(transform, method):
    def step(model, x):
        model(x)
        wreck(model)
        raise Boom("bad call")

    model = Tower()
    before = record(model)
    with pytest.raises(Boom):
        getattr(transform(step), method)(model, XX)
    assert_unchanged(before, model)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_compiled_called_with_another_structure_leaves_graphs_unchanged(transform):
    model, other = Tower(), Tower(seed=1)
    compiled = transform(forward).lower(model, XX).compile()
    other.extra = nnx.Param(jnp.zeros(3))  # another structure
    before = record(model, other)
    with pytest.raises(TypeError, match="lowered for"):
        compiled(other, XX)
    with pytest.raises(TypeError, match="lowered for"):
        compiled(model, jnp.ones((3, 4)))
    assert_unchanged(before, model, other)


@pytest.mark.usefixtures("settle_run_time_errors")
@pytest.mark.parametrize("transform", RUN_TIME_TRANSFORMS)
def test_compiled_run_time_error_leaves_graphs_unchanged(transform):
    model = Tower()
    ref = clone(model)
    compiled = transform(_runtime_step).lower(model, XX).compile()
    compiled(model, XX + 2.0)
    _runtime_step(ref, XX + 2.0)
    before = record(model)
    with pytest.raises(jax.errors.JaxRuntimeError, match="negative input at run time"):
        compiled(model, XX)
        jax.effects_barrier()
    assert_unchanged(before, model)
    np.testing.assert_allclose(compiled(model, XX + 2.0), _runtime_step(ref, XX + 2.0), 1e-6)
    assert_same_values(model, ref)
