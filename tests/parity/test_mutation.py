"""Mutation between calls: the caller changes the model, and the next call must see it.

Every case calls twice (the second call takes our fast path), mutates, calls twice
more, mutates again and calls once more; the mutations come in pairs (add, then change
or undo), so that a stale cache and a missed undo both show.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ._harness import X, parity


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=[])
@dataclasses.dataclass
class Params:
    w: Any
    b: Any


class Model(nnx.Module):
    """Small parts each mutation can touch; the optional ones are added by ``extras``."""

    def __init__(self, seed: int = 0, extras: tuple[str, ...] = ()):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.linear = nnx.Linear(2, 2, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(2, 2, rngs=rngs)])
        self.named = nnx.Dict(first=nnx.Linear(2, 2, rngs=rngs))
        self.a = nnx.Linear(2, 2, rngs=rngs)
        self.b = nnx.Linear(2, 2, rngs=rngs)
        self.items = nnx.data([jnp.ones(2)])
        self.extra = nnx.Param(jnp.full(2, 0.5))
        self.scale = 1.0
        self.count = nnx.BatchStat(jnp.array(0))
        if "bn" in extras:
            self.bn = nnx.BatchNorm(2, momentum=0.5, rngs=rngs)
        if "dropout" in extras:
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
        if "dataclass" in extras:
            self.p = nnx.data(Params(w=nnx.Param(jnp.ones(2)), b=jnp.zeros(2)))
        if "offset" in extras:
            self.offset = jnp.zeros(2)


def forward(m: Model, x: jax.Array) -> jax.Array:
    h = m.linear(x) * m.scale * m.linear.kernel.get_metadata("scale", 1.0)
    if hasattr(m, "bn"):
        h = m.bn(h)
    if hasattr(m, "dropout"):
        h = m.dropout(h)
    for block in m.blocks:
        h = block(h)
    for layer in m.named.values():
        h = layer(h)
    h = m.b(m.a(h))
    for item in m.items:
        h = h + item
    for name in ("extra", "more"):
        if hasattr(m, name):
            h = h + getattr(m, name)[...]
    if hasattr(m, "p"):
        h = h * m.p.w[...] + m.p.b
    if hasattr(m, "offset"):
        h = h + m.offset
    return h


def step(m: Model, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    m.count[...] += 1
    m.linear.bias[...] += 0.1
    return forward(m, x), m.count[...]


def linear(seed: int, **kwargs: Any) -> nnx.Linear:
    return nnx.Linear(2, 2, rngs=nnx.Rngs(seed), **kwargs)


def _delete_or_restore(m: Model, k: int) -> None:
    if k == 0:
        del m.extra
    else:
        m.extra = nnx.Param(jnp.full(2, 3.0))


def _rename(m: Model, k: int) -> None:
    old, new = ("extra", "more") if k == 0 else ("more", "extra")
    setattr(m, new, getattr(m, old))
    delattr(m, old)


def _share_then_unshare(m: Model, k: int) -> None:
    m.b = m.a if k == 0 else linear(30)


def _swap(m: Model, k: int) -> None:
    m.a, m.b = m.b, m.a


def _pop_then_append(m: Model, k: int) -> None:
    if k == 0:
        m.blocks.pop()
    else:
        m.blocks.append(linear(40))


def _train_eval(m: Model, k: int) -> None:
    m.eval() if k == 0 else m.train()


def _add_then_retype(m: Model, k: int) -> None:
    m.more = nnx.Param(jnp.full(2, 1.0)) if k == 0 else nnx.BatchStat(jnp.full(2, 2.0))


def _dataclass_fields(m: Model, k: int) -> None:
    m.p.w = nnx.Param(jnp.full(2, k + 2.0))
    m.p.b = jnp.full(2, k + 1.0)


# name -> (extras, mutate(model, k) for k = 0, 1)
MUTATIONS: dict[str, tuple[tuple[str, ...], Any]] = {
    "replace_submodule": ((), lambda m, k: setattr(m, "a", linear(10 + k))),
    "replace_submodule_other_structure": (
        (),
        lambda m, k: setattr(m, "a", linear(10, use_bias=bool(k))),
    ),
    "replace_with_clone": ((), lambda m, k: setattr(m, "a", nnx.clone(m.a))),
    "assign_value_from_outside": (
        (),
        lambda m, k: m.linear.kernel.__setitem__(..., m.linear.kernel[...] * 2),
    ),
    "set_value": ((), lambda m, k: m.linear.bias.set_value(jnp.full(2, k + 1.0))),
    "replace_variable": (
        (),
        lambda m, k: setattr(m.linear, "bias", nnx.Param(jnp.full(2, -float(k)))),
    ),
    "replace_variable_same_value": (
        (),
        lambda m, k: setattr(m, "extra", nnx.Param(m.extra[...])),
    ),
    "set_metadata": ((), lambda m, k: m.linear.kernel.set_metadata(scale=2.0 + k)),
    "add_attribute_then_change_its_type": ((), _add_then_retype),
    "delete_attribute_then_restore": ((), _delete_or_restore),
    "rename_attribute": ((), _rename),
    "append_to_list": ((), lambda m, k: m.blocks.append(linear(20 + k))),
    "pop_from_list_then_append": ((), _pop_then_append),
    "replace_list_item": ((), lambda m, k: m.blocks.__setitem__(0, linear(50 + k))),
    "add_dict_key": ((), lambda m, k: m.named.__setitem__(f"k{k}", linear(60 + k))),
    "train_eval": (("bn", "dropout"), _train_eval),
    "set_attributes_deterministic": (
        ("dropout",),
        lambda m, k: m.set_attributes(deterministic=k == 0),
    ),
    "reseed": (("dropout",), lambda m, k: nnx.reseed(m, dropout=7 + k)),
    "rng_count_from_outside": (
        ("dropout",),
        lambda m, k: m.dropout.rngs.count.__setitem__(..., jnp.uint32(10 + k)),
    ),
    "nnx_update_whole_state": ((), lambda m, k: nnx.update(m, nnx.state(Model(seed=5 + k)))),
    "nnx_update_params_only": (
        (),
        lambda m, k: nnx.update(m, nnx.state(Model(seed=5 + k), nnx.Param)),
    ),
    "swap_attributes": ((), _swap),
    "share_then_unshare": ((), _share_then_unshare),
    "static_attribute": ((), lambda m, k: setattr(m, "scale", 2.0 + k)),
    "dtype_change": ((), lambda m, k: m.extra.set_value(jnp.full(2, k + 1, jnp.bfloat16))),
    "numpy_value": ((), lambda m, k: m.linear.bias.set_value(np.full(2, k + 1.0, np.float32))),
    "data_list_append": ((), lambda m, k: m.items.append(jnp.full(2, k + 1.0))),
    "data_list_replace_element": ((), lambda m, k: m.items.__setitem__(0, jnp.full(2, -k))),
    "registered_dataclass_fields": (("dataclass",), _dataclass_fields),
    "plain_array_attribute": (("offset",), lambda m, k: setattr(m, "offset", jnp.full(2, k))),
    # graph mode gives each back as a jax array, even when the call does not change it
    "python_number_attribute": (("offset",), lambda m, k: setattr(m, "offset", (1.5, 2)[k])),
    "numpy_number_attribute": (("offset",), lambda m, k: setattr(m, "offset", np.float32(k))),
    "python_number_value": ((), lambda m, k: m.extra.set_value(k + 0.5)),
}

# `step` writes and reads everything; a read-only call (no write-back at all) is checked
# for the mutations that change values or metadata without changing the structure
READ_ONLY = [
    "assign_value_from_outside",
    "set_value",
    "replace_variable",
    "replace_variable_same_value",
    "set_metadata",
    "swap_attributes",
    "share_then_unshare",
    "static_attribute",
    "numpy_value",
    "data_list_replace_element",
    "registered_dataclass_fields",
    "plain_array_attribute",
    "python_number_attribute",
    "numpy_number_attribute",
    "python_number_value",
]
CASES = [
    pytest.param(extras, mutate, fn, id=f"{name}-{fn.__name__}")
    for name, (extras, mutate) in MUTATIONS.items()
    for fn in ([step, forward] if name in READ_ONLY else [step])
]


@pytest.mark.parametrize("extras, mutate, fn", CASES)
def test_mutation_between_calls(extras, mutate, fn):
    def scenario(impl, log):
        model = Model(extras=extras)
        f = impl.jit(fn)
        log.value("call0", f(model, X))
        log.value("call1", f(model, X))
        for k in range(2):
            mutate(model, k)
            log.value(f"call{2 + 2 * k}", f(model, X))
            if k == 0:
                log.value("call3", f(model, X))
            log.state(f"model{k}", model)

    parity(scenario)


# Named reproducers of the stale-cache items, written as a user would


def test_set_metadata_changes_the_next_result():
    # issue 15, A.1
    def scenario(impl, log):
        m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        f = impl.jit(lambda m, x: m(x) * m.kernel.get_metadata().get("scale", 1.0))
        a = log.value("a", f(m, X))
        log.value("a again", f(m, X))
        m.kernel.set_metadata(scale=2.0)
        b = log.value("b", f(m, X))
        log.fact("b == 2a", bool(jnp.allclose(b, 2 * a)))

    parity(scenario)


def test_metadata_read_by_a_filter_inside():
    def scale_trainable(m, x):
        trainable = nnx.state(m, lambda path, v: v.get_metadata("trainable", True))
        return m(x), len(jax.tree.leaves(trainable))

    def scenario(impl, log):
        m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        f = impl.jit(scale_trainable)
        log.value("before", f(m, X))
        log.value("before again", f(m, X))
        m.bias.set_metadata(trainable=False)
        log.value("after", f(m, X))
        log.value("after again", f(m, X))

    parity(scenario)


def test_registered_dataclass_fields_replaced():
    # issue 15, A.3
    def scenario(impl, log):
        m = nnx.Module()
        m.p = nnx.data(Params(w=nnx.Param(jnp.ones(2)), b=jnp.zeros(2)))
        f = impl.jit(lambda m, x: x * m.p.w[...] + m.p.b)
        log.value("a", f(m, X))
        log.value("a again", f(m, X))
        m.p.w = nnx.Param(jnp.full(2, 3.0))
        m.p.b = jnp.full(2, 1.0)
        log.value("b", f(m, X))
        log.value("b again", f(m, X))

    parity(scenario)


def test_structure_changed_inside_then_undone_outside():
    def grow(m, x):
        if not hasattr(m, "more"):
            m.more = nnx.Param(jnp.ones(2))
        m.more[...] += 1
        return forward(m, x)

    def scenario(impl, log):
        model = Model()
        f = impl.jit(grow)
        for i in range(5):
            log.value(f"out{i}", f(model, X))
            log.state(f"model{i}", model)
            if i in (1, 3):
                del model.more

    parity(scenario)


class Small(nnx.Module):
    def __init__(self):
        self.blocks = nnx.List([linear(0)])
        self.count = nnx.BatchStat(jnp.array(0))


def test_two_jitted_functions_alternate_on_one_model():
    def add(m, x):
        m.blocks.append(linear(len(m.blocks)))
        return len(m.blocks)

    def run_blocks(m, x):
        m.count[...] += 1
        for block in m.blocks:
            x = block(x)
        return x

    def scenario(impl, log):
        model = Small()
        f, g = impl.jit(add), impl.jit(run_blocks)
        for i in range(3):
            log.value(f"g{i}", g(model, X))
            log.value(f"g{i} again", g(model, X))
            log.value(f"f{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


def test_variable_moved_between_submodules():
    def scenario(impl, log):
        model = Model()
        f = impl.jit(step)
        log.value("0", f(model, X))
        log.value("1", f(model, X))
        model.a.bias, model.b.bias = model.b.bias, model.a.bias
        log.value("2", f(model, X))
        model.a.bias = model.b.bias  # one Variable in two places
        log.value("3", f(model, X))
        log.value("4", f(model, X))
        log.fact("shared", model.a.bias is model.b.bias)
        log.state("model", model)

    parity(scenario)


def test_value_assigned_from_outside_while_another_argument_changes():
    def scenario(impl, log):
        model = Model()
        other = nnx.Linear(2, 2, rngs=nnx.Rngs(3))
        f = impl.jit(lambda m, o, x: step(m, o(x)))
        for i in range(4):
            log.value(f"out{i}", f(model, other, X))
            other.kernel[...] = other.kernel[...] + 1.0
            if i == 2:
                other = nnx.Linear(2, 2, rngs=nnx.Rngs(4))
        log.state("after", model, other)

    parity(scenario)


def test_submodule_replaced_by_one_from_another_model():
    def scenario(impl, log):
        model, donor = Model(), Model(seed=9)
        f = impl.jit(step)
        log.value("0", f(model, X))
        log.value("1", f(model, X))
        model.a = donor.a  # now shared with the donor
        log.value("2", f(model, X))
        donor.a.kernel[...] = donor.a.kernel[...] * 3  # changed through the donor
        log.value("3", f(model, X))
        log.fact("shared", model.a is donor.a)
        log.state("after", model, donor)

    parity(scenario)
