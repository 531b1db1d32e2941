"""`inspect_sharding`: the lifted ``jax.debug.inspect_array_sharding`` and its timing."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def named(*spec):
    return NamedSharding(MESH, P(*spec))


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(4, 8, rngs=rngs)
        self.down = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


TP = nnx_sharding.StateSharding(
    [
        (nnx.All(nnx.PathContains("up"), nnx.PathContains("kernel")), P(None, "model")),
        (nnx.All(nnx.PathContains("up"), nnx.PathContains("bias")), P("model")),
        (nnx.All(nnx.PathContains("down"), nnx.PathContains("kernel")), P("model", None)),
        (..., P()),
    ]
)
EXPECTED = {
    ("up", "kernel"): named(None, "model"),
    ("up", "bias"): named("model"),
    ("down", "kernel"): named("model", None),
    ("down", "bias"): named(),
}


class Recorder:
    """A callback that keeps every tree it receives."""

    def __init__(self):
        self.calls = []

    def __call__(self, tree):
        self.calls.append(tree)


def placed_model():
    model = MLP()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jax.device_put(var.get_value(), EXPECTED[path]))
    return model


def flat_shardings(state):
    return {path: var.get_value() for path, var in nnx.to_flat_state(state)}


def assert_equivalent(actual, expected, ndim):
    assert actual.is_equivalent_to(expected, ndim), f"{actual} is not {expected}"


def test_eager_call_reports_at_once_in_the_input_structure():
    model, x = placed_model(), jax.device_put(jnp.ones((8, 4)), named("data"))
    seen = Recorder()

    nnx_sharding.inspect_sharding({"model": model, "x": x, "n": 3}, callback=seen)

    assert len(seen.calls) == 1
    tree = seen.calls[0]
    assert set(tree) == {"model", "x", "n"}
    assert isinstance(tree["model"], nnx.State)
    assert flat_shardings(tree["model"]) == EXPECTED
    assert isinstance(tree["model"]["up"]["kernel"], nnx.Param)  # the Variable type is kept
    assert tree["x"] == named("data")
    assert tree["n"] is None  # not an array


def test_eager_structure_is_that_of_get_named_sharding():
    model = placed_model()
    seen = Recorder()
    nnx_sharding.inspect_sharding(model, callback=seen)
    reference = nnx.get_named_sharding(nnx.state(model), MESH)
    # the specs differ (the arrays are placed by hand, not by metadata): compare the layout
    assert jax.tree.structure(seen.calls[0]) == jax.tree.structure(reference)


def test_variable_and_plain_arrays_and_empty_trees():
    seen = Recorder()
    variable = nnx.Param(jax.device_put(jnp.ones(8), named("model")))
    nnx_sharding.inspect_sharding([variable, jnp.ones(2)], callback=seen)
    ((var_out, array_out),) = seen.calls
    assert isinstance(var_out, nnx.Param) and var_out.get_value() == named("model")
    assert array_out == jax.sharding.SingleDeviceSharding(jax.devices()[0])

    nnx_sharding.inspect_sharding({"none": None, "n": 1}, callback=seen)
    assert seen.calls[1] == {"none": None, "n": None}


def test_inside_jit_on_one_device_reports_at_lowering_and_not_again():
    seen = Recorder()
    traces = []

    @nnx_sharding.jit
    def forward(model, x):
        traces.append(1)
        nnx_sharding.inspect_sharding((model, x), callback=seen)
        return model(x)

    model, x = MLP(), jnp.ones((2, 4))
    lowered = forward.lower(model, x)
    assert len(seen.calls) == 1  # at lowering, before any compilation
    state, x_sharding = seen.calls[0]
    assert set(flat_shardings(state)) == set(EXPECTED)
    for sharding in [*flat_shardings(state).values(), x_sharding]:
        assert sharding.is_fully_replicated and len(sharding.device_set) == 1

    lowered.compile()
    assert len(seen.calls) == 1  # the compiler had nothing to choose

    forward(model, x)  # jax's trace cache is shared with .lower(): nothing new
    forward(model, x)
    assert len(seen.calls) == 1 and len(traces) == 1


def test_partitioned_jit_reports_the_compiler_choice_at_compile_time():
    seen = Recorder()

    @nnx_sharding.jit(in_shardings=(TP, P("data")))
    def hidden(model, x):
        h = model.up(x)  # (data, -) @ (-, model): the compiler picks (data, model)
        nnx_sharding.inspect_sharding({"h": h, "model": model}, callback=seen)
        return model.down(nnx.relu(h))

    model, x = MLP(), jnp.ones((8, 4))
    with jax.set_mesh(MESH):
        lowered = hidden.lower(model, x)
        assert seen.calls == []  # not known at lowering
        compiled = lowered.compile()
        assert len(seen.calls) == 1
        tree = seen.calls[0]
        assert_equivalent(tree["h"], named("data", "model"), 2)
        ndims = {path: var.get_value().ndim for path, var in nnx.to_flat_state(nnx.state(model))}
        for path, sharding in flat_shardings(tree["model"]).items():
            assert_equivalent(sharding, EXPECTED[path], ndims[path])

        lowered.compile()
        compiled(model, x)
        assert len(seen.calls) == 1  # cached: not again


def test_partitioned_call_reports_once_then_stays_cached():
    seen = Recorder()

    @nnx_sharding.jit(in_shardings=(TP, P("data")))
    def forward(model, x):
        nnx_sharding.inspect_sharding(model(x), callback=seen)
        return model(x)

    # placed as in_shardings asks, so the first call's outputs do not change the key
    model, x = placed_model(), jax.device_put(jnp.ones((8, 4)), named("data"))
    with jax.set_mesh(MESH):
        forward(model, x)
        assert len(seen.calls) == 1
        assert_equivalent(seen.calls[0], named("data"), 2)
        forward(model, x)
        forward(model, x)
    assert len(seen.calls) == 1


@pytest.mark.parametrize("n_arrays", [1, 3])
def test_callback_fires_once_per_round_not_once_per_array(n_arrays):
    seen = Recorder()
    arrays = [jnp.ones(4) * i for i in range(n_arrays)]

    @jax.jit
    def f(*xs):
        nnx_sharding.inspect_sharding(list(xs), callback=seen)
        return xs

    f.lower(*arrays)
    assert len(seen.calls) == 1 and len(seen.calls[0]) == n_arrays
