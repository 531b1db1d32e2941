"""`nnx_sharding.jit`: NNX semantics of the call (compatible with ``flax.nnx.jit``).

Numbers are checked against an eager run on copies (`clone`: `nnx.clone` with its own
buffers); traces are counted with a Python counter inside the jitted function. Most
tests call more than once: the first call takes the full split/merge path, later ones
the cached fast path.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding

X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)


class Holder(nnx.Module):
    """Holds one graph node: two Holders of the same node share it."""

    def __init__(self, node):
        self.node = node


class Net(nnx.Module):
    """Parameters, batch statistics, a call counter and a list of heads."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.array(0))
        self.heads = nnx.List([nnx.Linear(3, 1, rngs=rngs)])

    def __call__(self, x):
        self.calls[...] += 1
        return self.heads[0](nnx.relu(self.bn(self.linear(x))))


class Stepper(nnx.Module):
    """A Module with jitted methods."""

    def __init__(self):
        self.w = nnx.Param(jnp.arange(3.0))
        self.steps = nnx.BatchStat(jnp.array(0))

    @nnx_sharding.jit
    def step(self, x):
        """Scales x by w and counts the call."""
        self.steps[...] += 1
        return self.w[...] * x

    @nnx_sharding.jit(static_argnums=2)
    def tiled(self, x, times):
        return jnp.tile(self.w[...] * x, times)

    @nnx_sharding.jit
    def grow(self):
        self.extra = nnx.Param(self.w[...] * 2)
        return self


def linear(seed: int = 0, din: int = 2, dout: int = 3, **kwargs) -> nnx.Linear:
    return nnx.Linear(din, dout, rngs=nnx.Rngs(seed), **kwargs)


def clone(node):
    """An eager reference: `nnx.clone`, with buffers of its own (it shares the
    original's, which donation would delete)."""
    graphdef, state = nnx.split(node)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.copy(), state))


def counting(fn, **options):
    """``(nnx_sharding.jit(fn), traces)``; ``len(traces)`` counts the traces."""
    traces = []

    @functools.wraps(fn)  # keeps fn's signature, which static/donate argnames need
    def body(*args, **kwargs):
        traces.append(None)
        return fn(*args, **kwargs)

    return nnx_sharding.jit(body, **options), traces


def assert_close(actual, expected):
    """Two pytrees (States included) with the same structure and close leaves."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), actual, expected
    )


def assert_same_objects(actual, expected):
    """Same pytree shape; graph nodes and Variables are the very same objects, arrays equal."""
    is_node = lambda x: isinstance(x, (nnx.Module, nnx.Variable, nnx.Rngs))  # noqa: E731
    got, want = (jax.tree.leaves(t, is_leaf=is_node) for t in (actual, expected))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if is_node(b):
            assert a is b
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def record(node):
    """What "unchanged" compares: structure, attribute names, Variable objects, values."""
    variables = [v for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)]
    return nnx.graphdef(node), sorted(vars(node)), variables, [v[...].tolist() for v in variables]


def assert_unchanged(node, before):
    graphdef, attributes, variables, values = record(node)
    assert (graphdef, attributes, values) == (before[0], before[1], before[3])
    assert len(variables) == len(before[2])
    assert all(v is old for v, old in zip(variables, before[2], strict=True))


def live_buffers(*nodes):
    """The current arrays of every Variable below ``nodes``."""
    return [v.get_raw_value() for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.Variable)]


def raw_jax_deletes_donated_buffers() -> bool:
    """What ``jax.jit`` itself does here with donated buffers, one changed, one not."""
    state = {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}
    jax.jit(lambda s: {"kernel": s["kernel"] + 1, "bias": s["bias"]}, donate_argnums=0)(state)
    assert state["kernel"].is_deleted() == state["bias"].is_deleted()
    return state["kernel"].is_deleted()


# 1. Arguments, keyword arguments and outputs: pytrees of arrays and graph nodes


def noisy_train_step(data, y):
    model, x = data["a"]
    optimizer, rngs = y
    noise = rngs.normal(x.shape)
    loss, grads = nnx.value_and_grad(lambda m: (m(x + noise) ** 2).mean())(model)
    optimizer.update(model, grads)
    return {"loss": loss, "noise": [noise]}


def test_nested_pytree_of_model_optimizer_rngs_and_arrays_matches_eager():
    model = linear()
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    rngs = nnx.Rngs(7)
    ref_model, ref_opt, ref_rngs = clone((model, opt, rngs))
    step = nnx_sharding.jit(noisy_train_step)
    for _ in range(3):
        out = step({"a": [model, X]}, y=(opt, rngs))
        assert_close(out, noisy_train_step({"a": [ref_model, X]}, y=(ref_opt, ref_rngs)))
    assert_close(nnx.state(model), nnx.state(ref_model))
    assert_close(nnx.state(opt), nnx.state(ref_opt))
    assert int(opt.step[...]) == 3
    assert int(rngs.default.count[...]) == int(ref_rngs.default.count[...]) == 3


def test_bare_variable_argument_is_updated_and_returned_as_itself():
    p = nnx.Param(jnp.arange(3.0))

    @nnx_sharding.jit
    def double(p):
        p[...] = p[...] * 2
        return p

    for expected in ([0.0, 2.0, 4.0], [0.0, 4.0, 8.0]):
        assert double(p) is p
        np.testing.assert_array_equal(p[...], expected)


@pytest.mark.parametrize(
    "make, members",
    [
        (lambda layers: nnx.List(layers), lambda c: list(c)),
        (lambda layers: nnx.Dict(first=layers[0], second=layers[1]), lambda c: list(c.values())),
    ],
    ids=["nnx.List", "nnx.Dict"],
)
def test_nnx_containers_as_arguments(make, members):
    def apply(layers, x):
        for layer in members(layers):
            layer.bias[...] += 1.0
        return [layer(x) for layer in members(layers)]

    layers = make([linear(0), linear(1)])
    ref = clone(layers)
    f = nnx_sharding.jit(apply)
    for _ in range(2):
        assert_close(f(layers, X), apply(ref, X))
    assert_close(nnx.state(layers), nnx.state(ref))


@pytest.mark.parametrize(
    "hyper",
    [(3, 4), [3, 4], {"a": 3, "b": 4}],
    ids=["tuple", "list", "dict"],
)
def test_module_with_a_plain_python_attribute(hyper):
    def forward(m, x):
        return m.node(x) * len(m.hyper)

    model = Holder(linear())
    model.hyper = hyper
    ref = clone(model)
    assert_close(nnx_sharding.jit(forward)(model, X), forward(ref, X))
    assert model.hyper == hyper


# 2. Shared references


def module_in_two_arguments():
    shared = linear()
    return (Holder(shared), Holder(shared)), lambda a, b: (a.node, b.node)


def module_twice():
    model = linear()
    return (model, model), lambda a, b: (a, b)


def variable_twice_in_one_argument():
    holder = Holder(nnx.Param(jnp.zeros(3)))
    holder.alias = holder.node
    return (holder,), lambda h: (h.node, h.alias)


def variable_and_its_module():
    model = linear()
    return (model.bias, model), lambda p, m: (p, m.bias)


@pytest.mark.parametrize(
    "make",
    [
        module_in_two_arguments,
        module_twice,
        variable_twice_in_one_argument,
        variable_and_its_module,
    ],
)
def test_shared_reference_is_one_object_inside_and_stays_shared(make):
    args, aliases = make()
    bias = lambda node: node.bias if isinstance(node, nnx.Module) else node  # noqa: E731

    @nnx_sharding.jit
    def f(*args):
        first, second = aliases(*args)
        assert first is second
        bias(first)[...] += 1.0  # written through one alias, read through the other
        return bias(second)[...]

    before = aliases(*args)[0]
    for n in (1.0, 2.0, 3.0):
        np.testing.assert_array_equal(f(*args), jnp.full(3, n))
    first, second = aliases(*args)
    assert first is second is before


@pytest.mark.parametrize(
    "build",
    [
        lambda m, x: m,
        lambda m, x: (m(x), m),
        lambda m, x: {"y": m(x), "nested": [(m,), {"kernel": m.kernel}]},
        lambda m, x: Holder(m),
    ],
    ids=["module", "in_tuple", "in_dict_with_variable", "new_module_holding_input"],
)
def test_input_objects_in_the_output_come_back_as_the_same_objects(build):
    model = linear()
    f = nnx_sharding.jit(build)
    for _ in range(3):
        out = f(model, X)
        expected = build(model, X)
        if isinstance(expected, Holder):  # new module: compare what it holds
            assert type(out) is Holder
            out, expected = out.node, expected.node
        assert_same_objects(out, expected)


def test_swapping_one_alias_of_a_shared_variable_leaves_the_other():
    shared = nnx.Param(jnp.zeros(2))
    a, b = Holder(shared), Holder(shared)

    @nnx_sharding.jit
    def f(a, b):
        a.node = nnx.Param(jnp.ones(2))
        b.node[...] += 5.0

    f(a, b)
    assert b.node is shared and a.node is not shared
    np.testing.assert_array_equal(a.node[...], jnp.ones(2))
    np.testing.assert_array_equal(shared[...], jnp.full(2, 5.0))


# 3. Variable updates reach the caller


def test_batch_statistics_and_counter_match_eager_training():
    model = Net()
    ref = clone(model)
    forward = nnx_sharding.jit(lambda m, x: m(x))
    for i in range(3):
        assert_close(forward(model, X * (i + 1)), ref(X * (i + 1)))
    assert int(model.calls[...]) == 3
    assert_close(nnx.state(model), nnx.state(ref))
    assert not np.allclose(model.bn.mean[...], 0.0)


@pytest.mark.parametrize("donate", [None, (0, 1)], ids=["kept", "donated"])
def test_optimizer_state_and_step_match_eager(donate):
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - 1.0) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    model = linear()
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    ref_model, ref_opt = clone((model, opt))
    step = nnx_sharding.jit(train_step, donate_argnums=donate)
    for _ in range(3):
        assert_close(step(model, opt, X), train_step(ref_model, ref_opt, X))
    assert int(opt.step[...]) == 3
    assert not any(x.is_deleted() for x in live_buffers(model, opt))
    assert_close(nnx.state((model, opt)), nnx.state((ref_model, ref_opt)))


def test_rngs_advance_so_calls_draw_new_numbers_like_eager():
    rngs, ref = nnx.Rngs(0), nnx.Rngs(0)
    draw = nnx_sharding.jit(lambda r: r.normal((4,)))
    first, second = draw(rngs), draw(rngs)
    assert not np.allclose(first, second)
    assert_close([first, second], [ref.normal((4,)), ref.normal((4,))])
    assert int(rngs.default.count[...]) == 2


def test_dropout_rngs_inside_a_module_match_eager():
    model = nnx.Dropout(0.5, rngs=nnx.Rngs(3))
    ref = clone(model)
    forward = nnx_sharding.jit(lambda m, x: m(x))
    outs = [forward(model, jnp.ones(16)) for _ in range(3)]
    assert_close(outs, [ref(jnp.ones(16)) for _ in range(3)])
    assert not np.array_equal(outs[0], outs[1])


# 4. Structure updates reach the caller


STRUCTURE_CHANGES = {
    "add_attribute": lambda m: setattr(m, "extra", nnx.Param(jnp.full(2, 4.0))),
    "replace_submodule": lambda m: setattr(m, "linear", linear(seed=5)),
    "delete_attribute": lambda m: delattr(m, "bn"),
    "swap_variable": lambda m: setattr(m.linear, "kernel", nnx.Param(jnp.full((2, 3), 0.5))),
    "append_layer": lambda m: m.heads.append(linear(seed=9, din=3, dout=1)),
}


@pytest.mark.parametrize("change", STRUCTURE_CHANGES.values(), ids=STRUCTURE_CHANGES.keys())
def test_structure_change_inside_reaches_the_callers_module(change):
    model = Net()
    ref = clone(model)
    nnx_sharding.jit(change)(model)
    change(ref)
    assert nnx.graphdef(model) == nnx.graphdef(ref)
    assert_close(nnx.state(model), nnx.state(ref))


def test_swapped_variable_is_a_new_object_with_the_new_value():
    model = linear()

    @nnx_sharding.jit
    def swap(m):
        m.bias = nnx.Param(m.bias[...] + 1.0)
        return m

    for n in (1.0, 2.0, 3.0):
        old = model.bias
        assert swap(model) is model
        assert model.bias is not old and isinstance(model.bias, nnx.Param)
        np.testing.assert_array_equal(model.bias[...], jnp.full(3, n))
        np.testing.assert_array_equal(old[...], jnp.full(3, n - 1.0))


# 5. Graph nodes created inside


def test_jitted_constructor_returns_concrete_modules_equal_to_eager():
    def make():
        layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        return layer, Holder(layer)

    model, holder = nnx_sharding.jit(make)()
    assert type(model) is nnx.Linear and holder.node is model
    assert isinstance(model.kernel.get_raw_value(), jax.Array)
    assert_close(nnx.state(model), nnx.state(linear()))
    assert nnx.graphdef(model) == nnx.graphdef(linear())


def test_jitted_init_builds_the_module_like_eager_and_traces_once():
    traces = []

    class Built(nnx.Module):
        @nnx_sharding.jit
        def __init__(self, rngs):
            traces.append(None)
            self.linear = nnx.Linear(2, 3, rngs=rngs)

    for seed in (0, 1):
        built = Built(nnx.Rngs(seed))
        assert type(built.linear) is nnx.Linear
        assert_close(nnx.state(built.linear), nnx.state(linear(seed)))
    assert len(traces) == 1


# 6. Trace counting


def param_total(m, x):
    params = jax.tree.leaves(nnx.state(m, nnx.Param))
    return m(x).sum() + sum(p.sum() for p in params)


def new_attribute(m):
    m.extra = nnx.Param(jnp.full(3, 10.0))
    return m, X


@pytest.mark.parametrize(
    "second_call, traces",
    [
        (lambda m: (m, X), 1),
        (lambda m: (linear(seed=1), X), 1),
        (lambda m: (m, jnp.ones((5, 2))), 2),
        (new_attribute, 2),
    ],
    ids=["same_model", "other_instance_same_structure", "new_shape", "new_attribute"],
)
def test_retraces_only_when_shapes_or_structure_change(second_call, traces):
    f, count = counting(param_total)
    model = linear()
    f(model, X)
    f(model, X)
    args = second_call(model)
    out = f(*args)
    assert len(count) == traces
    np.testing.assert_allclose(out, param_total(*clone(args)), rtol=1e-6)


# 8. Donation


@pytest.mark.parametrize(
    "options, call",
    [
        (dict(donate_argnums=0), lambda f, m, x: f(m, x)),
        (dict(donate_argnames="model"), lambda f, m, x: f(m, x)),
        (dict(donate_argnums=0), lambda f, m, x: f(model=m, x=x)),
    ],
    ids=["argnums", "argnames", "argnums_called_by_keyword"],
)
def test_donated_module_gets_new_buffers_and_old_ones_are_donated(options, call):
    def step(model, x):
        model.kernel[...] += 1.0  # the bias stays unchanged
        return model(x)

    model, x = linear(), X + 1.0
    ref = clone(model)
    f = nnx_sharding.jit(step, **options)
    deletes = raw_jax_deletes_donated_buffers()
    for _ in range(3):
        old = live_buffers(model)
        assert_close(call(f, model, x), step(ref, x))
        assert [b.is_deleted() for b in old] == [deletes] * len(old)
        assert not any(b.is_deleted() for b in live_buffers(model))
    assert not x.is_deleted()
    assert_close(nnx.state(model), nnx.state(ref))


def test_donation_never_leaves_a_deleted_buffer_in_a_module_sharing_variables():
    shared = linear()
    donated, kept = Holder(shared), Holder(shared)
    donated.own = nnx.Param(jnp.zeros(3))
    expected = nnx.state(clone(kept))

    @nnx_sharding.jit(donate_argnames="a")
    def f(a, b, x):
        a.own[...] += 1.0
        return b.node(x)

    for _ in range(3):
        f(donated, kept, X)
        assert not any(b.is_deleted() for b in live_buffers(donated, kept))
    assert donated.node is kept.node is shared
    assert_close(nnx.state(kept), expected)
    np.testing.assert_array_equal(donated.own[...], jnp.full(3, 3.0))


def test_donate_argnums_counts_static_arguments():
    model, x = linear(), X + 1.0
    old = live_buffers(model)
    f = nnx_sharding.jit(lambda n, m, x: m(x) * n, static_argnums=0, donate_argnums=1)
    assert_close(f(2, model, x), linear()(x) * 2)
    assert not x.is_deleted()  # the argument after the donated one is kept
    assert [b.is_deleted() for b in old] == [raw_jax_deletes_donated_buffers()] * 2
    assert not any(b.is_deleted() for b in live_buffers(model))


# 9. Static arguments


@pytest.mark.parametrize(
    "options, call",
    [
        (dict(static_argnums=1), lambda f, n: f(X, n)),
        (dict(static_argnums=1), lambda f, n: f(X, times=n)),
        (dict(static_argnames="times"), lambda f, n: f(X, times=n)),
        (dict(static_argnames="times"), lambda f, n: f(X, n)),
    ],
    ids=["argnums", "argnums_by_name", "argnames", "argnames_given_positionally"],
)
def test_static_argument_is_a_python_value_and_keys_the_cache(options, call):
    f, traces = counting(lambda x, times: jnp.tile(x, (times, 1)), **options)
    for n, expected_traces in ((2, 1), (2, 1), (3, 2)):
        np.testing.assert_array_equal(call(f, n), jnp.tile(X, (n, 1)))
        assert len(traces) == expected_traces


@pytest.mark.parametrize("options", [dict(static_argnums=1), dict(static_argnames="n")])
def test_static_argument_between_sharded_arguments(options):
    seen = {}

    def f(model, n, x):
        jax.debug.inspect_array_sharding(model.kernel[...], callback=lambda s: seen.update(k=s))
        jax.debug.inspect_array_sharding(x, callback=lambda s: seen.update(x=s))
        return model(x) * n

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    model = linear(din=3, dout=8, use_bias=False)
    x = jnp.arange(24.0).reshape(8, 3)  # P(None, 'x') would not divide it, nor P('x') the kernel
    g, traces = counting(f, in_shardings=(P(None, "x"), P("x")), **options)
    counts = []
    with jax.set_mesh(mesh):
        for n in (2, 2, 2, 3, 3):
            np.testing.assert_allclose(g(model, n, x), model(x) * n, rtol=1e-5)
            counts.append(len(traces))
    # the first two calls may both trace, as with raw jax.jit, if the first reshards the
    # caller's kernel; after that, only a new static value does
    assert counts[2:] == [counts[1], counts[1] + 1, counts[1] + 1]
    assert seen["k"].spec == P(None, "x")
    assert seen["x"].spec == P("x")


# 10. Methods, wrapper metadata


def test_jitted_method_updates_values_and_structure_of_self():
    model = Stepper()
    for _ in range(3):
        np.testing.assert_array_equal(model.step(jnp.full(3, 2.0)), jnp.arange(3.0) * 2)
    assert int(model.steps[...]) == 3
    assert model.grow() is model
    np.testing.assert_array_equal(model.extra[...], jnp.arange(3.0) * 2)


def test_jitted_method_static_argnums_count_self():
    model = Stepper()
    np.testing.assert_array_equal(model.tiled(2.0, 2), jnp.tile(jnp.arange(3.0) * 2, 2))


def documented(model, x):
    """Documented function."""
    return model(x)


@pytest.mark.parametrize(
    "wrapped, original",
    [
        (nnx_sharding.jit(documented), documented),
        (Stepper().step, Stepper.step.fun),
        (Stepper.step, Stepper.step.fun),
    ],
    ids=["function", "bound_method", "class_attribute"],
)
def test_wraps_keeps_name_doc_and_wrapped(wrapped, original):
    assert wrapped.__name__ == original.__name__
    assert wrapped.__doc__ == original.__doc__ and wrapped.__doc__
    assert wrapped.__wrapped__ is original


# eval_shape


def mutate_and_build(m):
    m.bias[...] += 1.0
    m.extra = nnx.Param(jnp.zeros(7))
    del m.kernel
    return m, nnx.Linear(3, 4, rngs=nnx.Rngs(0)), jnp.zeros((2, 5))


@pytest.mark.parametrize("donate", [None, 0], ids=["kept", "donated"])
def test_eval_shape_changes_no_state_and_returns_abstract_outputs(donate):
    model = linear()
    before = record(model)
    buffers = live_buffers(model)
    f = nnx_sharding.jit(mutate_and_build, donate_argnums=donate)
    same, new, array = f.eval_shape(model)
    assert_unchanged(model, before)
    assert not any(b.is_deleted() for b in buffers)
    assert array == jax.ShapeDtypeStruct((2, 5), jnp.float32)
    assert type(same) is nnx.Linear and same is not model
    assert same.extra.get_raw_value() == jax.ShapeDtypeStruct((7,), jnp.float32)
    assert not hasattr(same, "kernel")
    assert type(new) is nnx.Linear
    assert new.kernel.get_raw_value() == jax.ShapeDtypeStruct((3, 4), jnp.float32)


# Call forms


def test_decorator_with_and_without_arguments():
    @nnx_sharding.jit
    def plain(x):
        return x + 1

    @nnx_sharding.jit(static_argnums=1)
    def with_options(x, times):
        return jnp.tile(x, times)

    assert isinstance(plain, nnx_sharding.JitWrapped)
    assert isinstance(with_options, nnx_sharding.JitWrapped)
    np.testing.assert_array_equal(plain(jnp.arange(2.0)), [1.0, 2.0])
    np.testing.assert_array_equal(with_options(jnp.arange(2.0), 2), [0.0, 1.0, 0.0, 1.0])


def test_keyword_only_call_updates_the_model():
    def apply(*, model, x):
        model.bias[...] += 1.0
        return model(x)

    model = linear()
    ref = clone(model)
    f = nnx_sharding.jit(apply)
    for _ in range(2):
        assert_close(f(model=model, x=X), apply(model=ref, x=X))
    assert_close(nnx.state(model), nnx.state(ref))


def test_function_returning_none_still_updates():
    model = linear()
    bump = nnx_sharding.jit(lambda m: m.bias.__setitem__(..., m.bias[...] + 1.0))
    assert bump(model) is None and bump(model) is None
    np.testing.assert_array_equal(model.bias[...], jnp.full(3, 2.0))


@pytest.mark.parametrize("warm_calls", [0, 2], ids=["first_call", "after_cached_calls"])
def test_failure_inside_leaves_the_callers_module_as_before(warm_calls):
    @nnx_sharding.jit
    def f(m, x):
        m.bias[...] += 1.0
        if x.shape[0] == 5:
            m.kernel = nnx.Param(jnp.zeros((2, 3)))
            m.extra = nnx.Param(jnp.ones(()))
            del m.bias
            raise ValueError("bad batch")
        return m(x)

    model = linear()
    for _ in range(warm_calls):
        f(model, X)
    before = record(model)
    with pytest.raises(ValueError, match="bad batch"):
        f(model, jnp.ones((5, 2)))
    assert_unchanged(model, before)
    ref = clone(model)
    assert_close(f(model, X), f.fun(ref, X))  # and the next call works as usual
    assert_close(nnx.state(model), nnx.state(ref))


# --- the signature a user reads (inspect.signature, help) is flax's, plus jax's extras

JIT_EXTRAS = {"compiler_options"}  # jax.jit's, which flax's nnx.jit does not take


def test_signature_has_every_parameter_of_flax_jit():
    import pydoc

    ours = inspect.signature(nnx_sharding.jit).parameters
    theirs = inspect.signature(nnx.jit).parameters
    assert list(theirs)[0] == list(ours)[0] == "fun"
    missing = [name for name in theirs if name not in ours]
    assert missing == [], f"flax's nnx.jit takes {missing}, nnx_sharding.jit does not"
    assert set(ours) - set(theirs) == JIT_EXTRAS
    for name in list(theirs)[1:]:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        if name in ("graph", "graph_updates", "keep_unused", "inline", "device", "backend"):
            assert ours[name].default == theirs[name].default, name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    text = pydoc.render_doc(nnx_sharding.jit, renderer=pydoc.plaintext)
    assert all(f"{name}:" in text for name in theirs), text


def test_an_in_sharding_of_too_high_rank_is_a_structured_error_naming_each_variable():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    rules = nnx_sharding.StateSharding({nnx.Param: P(None, None, "model")})
    f = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(rules, None))
    with jax.set_mesh(mesh), pytest.raises(ValueError) as error:
        f(model, jnp.ones((4, 16)))
    message = str(error.value)
    assert message.startswith("jit: in_shardings: 2 problems:\n  - args[0].bias: shape (64,)")
    assert "  - args[0].kernel: shape (16, 64)" in message
    assert "the spec needs rank at least 3, but the value has rank 2" in message
    assert "\nFixes:\n  1. change the filter or spec" in message


def test_in_shardings_with_keyword_arguments_says_to_pass_them_positionally_and_that_works():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, x = nnx.Linear(16, 64, rngs=nnx.Rngs(0)), jnp.ones((4, 16))
    f = nnx_sharding.jit(lambda m, x: m(x), in_shardings=(None, P("data")))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError) as error:
            f(m=model, x=x)
        assert "\n  3. pass the arguments positionally: as in `jax.jit`," in str(error.value)
        assert jnp.array_equal(f(model, x), model(x))  # fix 3
