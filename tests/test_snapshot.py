"""What the fast path must see change between calls (`snapshot`, `cache`).

Each test warms the cache with two calls, changes the model from outside, and checks
the third call against flax's ``nnx.jit`` on a twin built the same way.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_sharding

JITS = [nnx.jit, nnx_sharding.jit]
X = jnp.ones((1, 2))


def _on_both(build, fun, change, calls=2):
    """``fun``'s results and the model's state, under flax and ours, after ``change``."""
    results = []
    for jit in JITS:
        model = build()
        jitted = jit(fun)
        for _ in range(calls):
            jitted(model)
        change(model)
        out = jitted(model)
        results.append((out, nnx.to_pure_dict(nnx.state(model))))
    return results


def _assert_same(results):
    (flax_out, flax_state), (our_out, our_state) = results
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), flax_out, our_out))
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), flax_state, our_state)
    )


def _scaled(model):
    return model(X) * model.kernel.get_metadata().get("scale", 1.0)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.kernel.set_metadata(scale=2.0),  # in place
        lambda m: m.kernel.set_metadata("scale", 3.0),
        lambda m: m.kernel.set_metadata({"scale": 4.0}),  # a new metadata dict
    ],
    ids=["kwargs", "name-value", "whole-dict"],
)
def test_a_metadata_change_is_seen(change):
    results = _on_both(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), _scaled, change)
    _assert_same(results)
    assert not jnp.allclose(results[1][0], nnx.Linear(2, 2, rngs=nnx.Rngs(0))(X))


def test_a_metadata_filter_read_inside_sees_the_change():
    def count_trainable(model):
        return len(jax.tree.leaves(nnx.state(model, lambda _, v: v.get_metadata().get("on", 1))))

    results = _on_both(
        lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        count_trainable,
        lambda m: nnx.set_metadata(m, on=0),
    )
    _assert_same(results)
    assert results[1][0] == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    w: jax.Array
    b: jax.Array


def _with_pair():
    module = nnx.Module()
    module.p = nnx.data(Pair(nnx.Param(jnp.ones(2)), nnx.Param(jnp.zeros(2))))
    return module


def _replace_pair_fields(module):
    module.p.w = nnx.Param(jnp.full(2, 5.0))
    module.p.b = nnx.Param(jnp.full(2, 1.0))


def test_a_field_of_a_registered_dataclass_held_with_nnx_data_is_seen():
    results = _on_both(_with_pair, lambda m: m.p.w[...] + m.p.b[...], _replace_pair_fields)
    _assert_same(results)
    assert results[1][0].tolist() == [6.0, 6.0]


class Counter(nnx.Module):
    def __init__(self):
        self.count = jnp.array(0)  # a plain array attribute, outside any Variable


def _bump(counter):
    counter.count += 1
    return counter.count


@pytest.mark.parametrize("jit", JITS, ids=["flax", "ours"])
def test_a_plain_array_attribute_updated_inside_is_written_back(jit):
    counter, bump = Counter(), jit(_bump)
    assert [int(bump(counter)) for _ in range(3)] == [1, 2, 3]
    assert int(counter.count) == 3


def test_a_plain_array_attribute_set_from_outside_is_seen():
    def set_count(counter):
        counter.count = jnp.array(10)

    _assert_same(_on_both(Counter, lambda c: c.count * 2, set_count))


@pytest.mark.parametrize("jit", JITS, ids=["flax", "ours"])
def test_ref_variables_are_updated_in_place(jit):
    module = nnx.Module()
    module.w = nnx.Param(jnp.ones(3), ref=True)

    @jit
    def bump(module):
        module.w[...] += 1

    sums = []
    for _ in range(3):
        bump(module)
        sums.append(float(module.w[...].sum()))
    assert sums == [6.0, 9.0, 12.0]


def test_numpy_values_come_back_as_jax_arrays_as_in_flax():
    def build():
        module = nnx.Module()
        module.w = nnx.Param(np.ones(3))
        module.c = nnx.data(np.zeros(2))
        return module

    def set_numpy(module):
        module.w.set_value(np.full(3, 2.0))  # between fast calls: the Variable is unchanged

    kinds = []
    for jit in JITS:
        module = build()
        f = jit(lambda m: m.w[...].sum())
        f(module)
        f(module)
        kinds.append((type(module.w.get_raw_value()), type(module.c)))
        set_numpy(module)
        assert float(f(module)) == 6.0
        kinds.append((type(module.w.get_raw_value()), type(module.c)))
    assert kinds[:2] == kinds[2:]
    assert all(issubclass(k, jax.Array) for pair in kinds for k in pair)
