"""Differences against flax found by a hunt over the newest paths (the fast path with
plain array attributes, tree mode, graph_updates=False), kept as differential tests.

Each case calls twice (the second call takes our fast path where there is one), then
changes the shape of an input so that jax traces again on what would be a fast call,
and the new trace builds an output of another structure.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ._harness import X, mesh8, parity


class Holder(nnx.Module):
    def __init__(self) -> None:
        self.a = jnp.ones(2)  # a plain array attribute
        self.p = nnx.Param(jnp.ones(2))
        self.count = nnx.BatchStat(jnp.array(0))


def _new_variable_when_wide(m: Holder, x: jax.Array) -> object:
    m.count[...] += 1
    if m.a.shape[0] == 3 or m.p.shape[0] == 3:  # shapes are static: one branch a trace
        return {"sum": m.a.sum() + m.p[...].sum(), "new": nnx.Param(m.p[...] * 2)}
    return m.a.sum() + x.sum()


def _new_module_when_wide(m: Holder, x: jax.Array) -> object:
    m.count[...] += 1
    if m.a.shape[0] == 3 or m.p.shape[0] == 3:
        return nnx.Linear(2, 2, rngs=nnx.Rngs(0)), m.p[...].sum()
    return m.a.sum() + x.sum()


@pytest.mark.parametrize("fn", [_new_variable_when_wide, _new_module_when_wide])
@pytest.mark.parametrize("widen", ["plain_array", "variable_value"])
def test_a_retrace_on_a_fast_call_that_builds_new_graph_nodes(fn, widen):
    # Was: ours raised flax's TraceContextError ("Cannot mutate Param from a different
    # trace level"), then an AssertionError on every later call, where flax returns the
    # new Variable: the trace made (and given up) on the fast call left its references
    # in the update context that the full path then used.
    def scenario(impl, log):
        m = Holder()
        f = impl.jit(fn)
        for i in range(2):
            log.value(f"out{i}", f(m, X))
        if widen == "plain_array":
            m.a = jnp.ones(3)
        else:
            m.p.set_value(jnp.ones(3))
        for i in range(2, 5):
            log.value(f"out{i}", f(m, X))
        log.state("m", m)
        if widen == "plain_array":
            m.a = jnp.ones(2)
        else:
            m.p.set_value(jnp.ones(2))
        for i in range(5, 7):
            log.value(f"out{i}", f(m, X))
        log.state("m again", m)

    parity(scenario)


def _variable_when_wide(m: Holder) -> object:
    if m.a.shape[0] == 4:
        return nnx.Param(m.p[...] * 2)
    return m.p[...] * 2


def test_shard_map_retrace_on_a_fast_call_that_builds_a_variable():
    # the same defect through shard_map's fast path
    def scenario(impl, log):
        m = Holder()
        f = impl.shard_map(_variable_when_wide, mesh=mesh8(), in_specs=P(), out_specs=P())
        for i in range(2):
            log.value(f"out{i}", f(m))
        m.a = jnp.ones(4)
        for i in range(2, 4):
            log.value(f"out{i}", f(m))
        log.state("m", m)

    parity(scenario)


def test_cached_partial_retrace_on_a_fast_call_that_builds_a_variable():
    # the same defect under flax's nnx.cached_partial wrapped around our jit (a module
    # without plain array attributes: flax's cached_partial fails on those itself)
    def scenario(impl, log):
        m = nnx.Module()
        m.p, m.count = nnx.Param(jnp.ones(2)), nnx.BatchStat(jnp.array(0))
        m.a = nnx.Param(jnp.ones(2))
        f = nnx.cached_partial(impl.jit(_new_variable_when_wide), m)
        for i in range(2):
            log.value(f"out{i}", f(X))
        m.p.set_value(jnp.ones(3))
        for i in range(2, 4):
            log.value(f"out{i}", f(X))
        log.state("m", m)

    parity(scenario)
