"""The fast path (`_cache`): cached splits must never serve a stale graph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_sharding


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, seed: int):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.bn = nnx.BatchNorm(dout, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


class Model(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.array(0))
        self.first = Block(2, 4, 0)
        self.layers = nnx.List([Block(4, 4, 1)])

    def __call__(self, x):
        self.count[...] += 1
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return x


X = jnp.linspace(0.0, 1.0, 6).reshape(3, 2)


@nnx_sharding.jit
def forward(model, x):
    return model(x)


@nnx_sharding.jit
def bump_bias(model):
    model.first.linear.bias[...] += 1.0


def _replace_attribute(model):
    model.first = Block(2, 4, 7)


def _swap_variable(model):
    model.first.linear.kernel = nnx.Param(jnp.full((2, 4), 0.5))


def _append_layer(model):
    model.layers.append(Block(4, 4, 3))


def _set_value(model):
    model.first.linear.bias[...] = jnp.full((4,), 2.0)


def _other_jit(model):
    bump_bias(model)


def _toggle_static(model):
    model.eval()  # BatchNorm's use_running_average: a static attribute, a new graphdef


def _grow_plain_list(model):
    model.extras.append(nnx.Param(jnp.ones(())))  # a list held with nnx.data: not a Pytree


class ModelWithList(Model):
    def __init__(self):
        super().__init__()
        self.extras = nnx.data([nnx.Param(jnp.zeros(()))])

    def __call__(self, x):
        return super().__call__(x) + sum(p[...] for p in self.extras)


CHANGES = [
    _replace_attribute,
    _swap_variable,
    _append_layer,
    _set_value,
    _other_jit,
    _toggle_static,
    _grow_plain_list,
]


@pytest.mark.parametrize("change", CHANGES)
def test_change_between_calls_is_seen(change):
    model = ModelWithList()
    for _ in range(3):  # warm the cache: later calls take the fast path
        forward(model, X)
    change(model)
    # reference: the same program on a copy, through a fresh jit (no cache)
    reference = nnx.clone(model)
    expected = nnx_sharding.jit(lambda m, x: m(x))(reference, X)
    np.testing.assert_array_equal(forward(model, X), expected)
    assert int(model.count[...]) == int(reference.count[...]) == 4
    np.testing.assert_array_equal(model.first.bn.mean[...], reference.first.bn.mean[...])


def test_fast_path_keeps_updating_the_callers_variables():
    model, reference = Model(), Model()
    for _ in range(5):
        out = forward(model, X)
        expected = reference(X)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert int(model.count[...]) == 5
    np.testing.assert_allclose(model.layers[0].bn.var[...], reference.layers[0].bn.var[...])


def test_no_retrace_on_the_fast_path():
    traces = []

    @nnx_sharding.jit
    def step(model, x):
        traces.append(1)
        return model(x)

    model = Model()
    for _ in range(5):
        step(model, X)
    assert len(traces) == 1
    step(model, jnp.ones((5, 2)))  # new shape: jax traces again, on the full path
    assert len(traces) == 2
    step(model, X)
    assert len(traces) == 2


def test_structure_change_inside_disables_the_fast_path_for_that_plan():
    @nnx_sharding.jit
    def grow(model):
        model.extra = nnx.Param(jnp.zeros(()))

    model = Model()
    grow(model)
    assert isinstance(model.extra, nnx.Param)
    del model.extra
    grow(model)  # the same plan again: must still write the new attribute back
    assert isinstance(model.extra, nnx.Param)


def test_cache_entry_dies_with_its_module():
    import gc

    @nnx_sharding.jit
    def f(model, x):
        return model(x)

    model = Model()
    f(model, X)
    assert len(f._entries) == 1
    del model
    gc.collect()
    assert len(f._entries) == 0


def test_a_call_waits_for_its_program_only_when_it_has_host_callbacks(monkeypatch):
    """A run-time error can only come from a host callback: such programs are waited for
    before the write-back (so it raises with the Variables untouched); others stay async."""
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(1) or real(x))

    def quiet(c):
        c["n"][...] += 1

    def chatty(c):
        c["n"][...] += 1
        jax.debug.callback(lambda n: None, c["n"][...])

    def make():
        return nnx.Dict(n=nnx.BatchStat(jnp.array(0)))

    for fun, expected in [(quiet, 0), (chatty, 3)]:
        counter, f = make(), nnx_sharding.jit(fun)
        for _ in range(3):  # the first call traces; the others take the fast path
            f(counter)
        assert len(waited) == expected, fun.__name__
        assert int(counter["n"][...]) == 3
    compiled = nnx_sharding.jit(chatty).lower(make()).compile()
    compiled(make())
    assert len(waited) == 4


def test_renamed_attribute_is_seen():
    """Renaming the last attribute leaves the module's values, in order, as they were:
    only its keys tell the change."""
    model = Model()
    for _ in range(3):
        forward(model, X)
    model.blocks = model.layers
    del model.layers
    with pytest.raises(AttributeError, match="layers"):
        forward(model, X)


@pytest.mark.parametrize("change", CHANGES)
def test_compiled_sees_or_refuses_each_change(change):
    """Compiled.__call__ shares the fast path: a change that keeps the graph definition
    (new objects of the same structure too) is seen; one that changes it is refused, as
    the program was compiled for one structure. Never served stale."""
    model = ModelWithList()
    compiled = forward.lower(model, X).compile()
    for _ in range(3):
        compiled(model, X)
    graphdef = nnx.graphdef(model)
    change(model)
    reference = nnx.clone(model)
    if nnx.graphdef(model) == graphdef:
        expected = nnx_sharding.jit(lambda m, x: m(x))(reference, X)
        np.testing.assert_array_equal(compiled(model, X), expected)
        np.testing.assert_array_equal(model.first.bn.mean[...], reference.first.bn.mean[...])
    else:
        with pytest.raises(TypeError, match=r"(?s)jit: .*args\[0\]"):
            compiled(model, X)
        assert nnx.graphdef(model) == nnx.graphdef(reference)  # nothing written back
        np.testing.assert_array_equal(model.count[...], reference.count[...])


def test_compiled_takes_the_fast_path(monkeypatch):
    from nnx_sharding import _stages

    splits = []
    real = _stages.split_call
    monkeypatch.setattr(_stages, "split_call", lambda *a: splits.append(1) or real(*a))
    model = Model()
    compiled = forward.lower(model, X).compile()
    for _ in range(4):
        compiled(model, X)
    assert len(splits) == 1  # the first call splits and caches; the others reuse it
    assert int(model.count[...]) == 4


def test_fast_path_names_a_bad_value_set_from_outside():
    """jax's complaint about a flat argument (``kept[3]``) is redone on the full path,
    which names the Variable."""
    model = Model()
    for _ in range(2):
        forward(model, X)
    model.first.linear.bias.set_raw_value("oops")
    with pytest.raises(TypeError, match=r"args\[0\]\.first\.linear\.bias"):
        forward(model, X)


def test_compiled_names_a_changed_shape_set_from_outside():
    model = Model()
    compiled = forward.lower(model, X).compile()
    compiled(model, X)
    compiled(model, X)
    model.first.linear.bias[...] = jnp.zeros((4,))  # same shape: fine
    compiled(model, X)
    model.first.linear.bias = nnx.Param(jnp.zeros((5,)))
    with pytest.raises(TypeError, match=r"args\[0\]\.first\.linear\.bias: got float32\[5\]"):
        compiled(model, X)
