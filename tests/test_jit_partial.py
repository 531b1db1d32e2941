"""`jit_partial` (`jit_partial`) against flax's ``nnx.jit_partial``, and ``nnx.cached_partial``
over `nnx_sharding.jit`: results, state after calls, write-back, errors."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding

X = jnp.linspace(-1.0, 1.0, 16).reshape(8, 2)
Y = jnp.sin(X[:, :1]) + X[:, 1:] ** 2
IMPLS = {"flax": getattr(nnx, "jit_partial", None), "ours": nnx_sharding.jit_partial}
needs_flax_jit_partial = pytest.mark.skipif(
    IMPLS["flax"] is None, reason="nnx.jit_partial is new in flax 0.12.8"
)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(2, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.head(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def make():
    model = Net(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def state(*nodes):
    return jax.tree.map(lambda x: x, nnx.state(nodes))


def same(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(jnp.allclose(x, y) for x, y in zip(a, b, strict=True))


def both(run):
    """``run(jit_partial)`` under flax's and ours."""
    return {name: run(impl) for name, impl in IMPLS.items()}


# ----------------------------------------------------------------------------- results, state
@pytest.mark.parametrize("donate", [None, 0], ids=["kept", "donated"])
@pytest.mark.parametrize(
    "mode", [dict(graph=False), dict(graph=True, graph_updates=False)], ids=["tree", "graph"]
)
@needs_flax_jit_partial
def test_train_step_matches_flax(donate, mode):
    def run(jit_partial):
        model, optimizer = make()
        step = jit_partial(train_step, model, optimizer, donate_argnums=donate, **mode)
        losses = [step(X, Y) for _ in range(3)]
        model.head.kernel[...] = model.head.kernel[...] * 0.5  # an update between calls
        losses.append(step(x=X, y=Y))
        return losses, state(model, optimizer)

    out = both(run)
    assert same(out["flax"], out["ours"])
    losses = out["ours"][0]
    assert losses[0] > losses[2]  # it trains
    assert int(out["ours"][1][0]["calls"][...]) == 4  # every call's counter was written back
    assert int(out["ours"][1][1]["step"][...]) == 4


@needs_flax_jit_partial
def test_variables_changed_between_calls_are_used_and_may_change_shape():
    def f(m, x):
        return m.w[...] * x

    def run(jit_partial):
        m = nnx.Module()
        m.w = nnx.Param(jnp.ones(3))
        g = jit_partial(f, m, graph=False)
        outs = [g(2.0)]
        m.w[...] = jnp.arange(3.0)
        outs.append(g(2.0))
        m.w.set_value(jnp.ones(4))  # a new shape: a new trace
        outs.append(g(2.0))
        return outs

    out = both(run)
    assert same(out["flax"], out["ours"])
    assert out["ours"][2].shape == (4,)


@needs_flax_jit_partial
def test_structure_is_fixed_at_construction():
    """A Variable attached after jit_partial is not seen; one attached inside is dropped
    (flax's contract), in tree mode and in graph mode without graph_updates."""

    def f(m):
        m.extra = nnx.Param(jnp.zeros(2))
        return m.w[...].sum()

    def run(jit_partial):
        outs = []
        for mode in (dict(graph=False), dict(graph=True, graph_updates=False)):
            m = nnx.Module()
            m.w = nnx.Param(jnp.ones(3))
            g = jit_partial(f, m, **mode)
            first = g()
            m.w = nnx.Param(jnp.full(3, 7.0))  # a new Variable: not the bound one
            outs.append((first, g(), hasattr(m, "extra")))
        return outs

    out = both(run)
    assert same(out["flax"], out["ours"])
    assert [o[1] for o in out["ours"]] == [3.0, 3.0]
    assert [o[2] for o in out["ours"]] == [False, False]


@needs_flax_jit_partial
def test_shared_variables_in_graph_mode():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.ones(3))
            self.b = self.a

    def f(t):
        t.a[...] += 1.0
        return t.b[...]

    def run(jit_partial):
        t = Tied()
        g = jit_partial(f, t, graph=True, graph_updates=False)
        return g(), g(), t.a[...]

    out = both(run)
    assert same(out["flax"], out["ours"])
    assert jnp.allclose(out["ours"][2], 3.0)


@needs_flax_jit_partial
def test_graph_updates_in_graph_mode_is_accepted_here():
    """flax refuses graph=True with graph_updates=True; ours takes it (shared Variables
    kept) and refuses only a structure change it cannot write back."""
    model, optimizer = make()
    with pytest.raises(ValueError, match="`graph_updates` not supported"):
        nnx.jit_partial(train_step, model, optimizer, graph=True, graph_updates=True)
    ref_model, ref_opt = make()
    ref = nnx.jit_partial(train_step, ref_model, ref_opt, graph=False)
    ours = nnx_sharding.jit_partial(train_step, model, optimizer)  # the defaults: True, True
    assert same([ref(X, Y) for _ in range(2)], [ours(X, Y) for _ in range(2)])
    assert same(state(ref_model, ref_opt), state(model, optimizer))

    def grow(m):
        m.extra = nnx.Param(jnp.zeros(2))

    before = state(model)
    with pytest.raises(ValueError, match=r"changed the graph structure of partial_args\[0\]"):
        nnx_sharding.jit_partial(grow, model)()
    assert not hasattr(model, "extra") and same(before, state(model))


@needs_flax_jit_partial
def test_outputs_new_modules_and_arrays():
    def f(m, x):
        new = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
        return {"y": m.w[...] * x, "new": new}

    def run(jit_partial):
        m = nnx.Module()
        m.w = nnx.Param(jnp.ones(2))
        out = jit_partial(f, m, graph=False)(3.0)
        assert isinstance(out["new"], nnx.Linear)
        return out["y"], nnx.state(out["new"])

    out = both(run)
    assert same(out["flax"], out["ours"])


@needs_flax_jit_partial
def test_donated_runtime_argument():
    def f(m, x):
        return m.w[...] + x

    def run(jit_partial):
        m = nnx.Module()
        m.w = nnx.Param(jnp.ones(3))
        x = jnp.ones(3)
        out = jit_partial(f, m, graph=False, donate_argnums=1)(x)
        return out, x.is_deleted()

    out = both(run)
    assert out["flax"][1] is out["ours"][1] is True
    assert same(out["flax"][0], out["ours"][0])


def test_donated_partial_arguments_get_new_buffers():
    model, optimizer = make()
    old = model.head.kernel.get_raw_value()
    step = nnx_sharding.jit_partial(train_step, model, optimizer, graph=False, donate_argnums=0)
    step(X, Y)
    assert old.is_deleted()
    assert not any(
        x.is_deleted() for x in jax.tree.leaves(nnx.state((model, optimizer)))
    )  # every donated Variable, changed or not, holds a live array
    step(X, Y)


@pytest.mark.parametrize("kw", [dict(static_argnums=1), dict(static_argnames="x")])
@needs_flax_jit_partial
def test_static_arguments_count_as_flax_counts_them(kw):
    traces = []

    def f(m, x, y):
        traces.append(x)
        return m.w[...] * x + y

    def run(jit_partial):
        traces.clear()
        m = nnx.Module()
        m.w = nnx.Param(jnp.ones(2))
        g = jit_partial(f, m, graph=False, **kw)
        outs = [g(2.0, jnp.ones(2)), g(2.0, jnp.zeros(2)), g(3.0, jnp.zeros(2))]
        return outs, list(traces)

    out = both(run)
    assert same(out["flax"][0], out["ours"][0])
    assert out["flax"][1] == out["ours"][1] == [2.0, 3.0]  # static: a trace per value


def test_eval_shape_writes_nothing():
    model, optimizer = make()
    before = state(model, optimizer)
    step = nnx_sharding.jit_partial(train_step, model, optimizer, graph=False)
    out = step.eval_shape(X, Y)
    assert out.shape == () and out.dtype == jnp.float32 and not isinstance(out, jax.Array)
    assert same(before, state(model, optimizer))


# ----------------------------------------------------------------------------- errors
@needs_flax_jit_partial
def test_shared_variable_in_tree_mode_is_an_error():
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.ones(3))
            self.b = self.a

    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="Duplicate"):
            impl(lambda t: t.a[...], Tied(), graph=False)
    with pytest.raises(ValueError) as e:
        nnx_sharding.jit_partial(lambda t: t.a[...], Tied(), graph=False)
    assert "partial_args[0].a, partial_args[0].b" in str(e.value)
    assert "pass graph=True" in str(e.value)
    fixed = nnx_sharding.jit_partial(lambda t: t.a[...], Tied(), graph=True)  # fix 1 works
    assert jnp.allclose(fixed(), 1.0)


@needs_flax_jit_partial
def test_variable_in_call_arguments_is_an_error():
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(3))
    for impl in IMPLS.values():
        g = impl(lambda m, v: m.w[...] + v[...], m, graph=False)
        with pytest.raises(ValueError, match="Variable in non-partial arguments"):
            g(nnx.Param(jnp.ones(3)))
    with pytest.raises(ValueError, match=r"a Variable at args\[0\]"):
        nnx_sharding.jit_partial(lambda m, v: v, m, graph=False)(nnx.Param(jnp.ones(3)))


@needs_flax_jit_partial
def test_returning_an_input_variable_is_an_error():
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(3))
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="Duplicate"):
            impl(lambda m: m.w, m, graph=False)()
    with pytest.raises(ValueError, match=r"twice\) at output\n"):
        nnx_sharding.jit_partial(lambda m: m.w, m, graph=False)()


@needs_flax_jit_partial
def test_returning_the_partial_module_gives_it_back():
    """flax raises (its Variables are aliased); ours returns the very object."""
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(3))

    def f(m):
        m.w[...] += 1.0
        return m, m.w[...]

    with pytest.raises(ValueError, match="Duplicate"):
        nnx.jit_partial(f, m, graph=False)()
    out, value = nnx_sharding.jit_partial(f, m, graph=False)()
    assert out is m and jnp.allclose(m.w[...], 2.0) and jnp.allclose(value, 2.0)


@needs_flax_jit_partial
def test_metadata_change_inside_is_an_error():
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(3))

    def f(m):
        m.w.set_metadata("tag", 1)
        m.w[...] += 1.0

    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="metadata changed inside jit"):
            impl(f, m, graph=False)()
    assert jnp.allclose(m.w[...], 1.0)


@needs_flax_jit_partial
def test_inside_an_outer_transform_nothing_is_written():
    m = nnx.Module()
    m.w = nnx.Param(jnp.ones(3))

    def f(m, x):
        m.w[...] += x
        return m.w[...].sum()

    for impl in IMPLS.values():
        g = impl(f, m, graph=False)
        with pytest.raises(flax_errors.TraceContextError):
            jax.jit(g)(1.0)
        assert jnp.allclose(m.w[...], 1.0)


def test_not_callable():
    with pytest.raises(TypeError, match="jit_partial: fun: expected a callable"):
        nnx_sharding.jit_partial(3)


# ----------------------------------------------------------------------------- shardings
def test_in_shardings_lay_out_the_partial_state():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    model, optimizer = make()
    shardings = nnx_sharding.StateSharding({nnx.Param: P(), ...: None})
    with jax.set_mesh(mesh):
        step = nnx_sharding.jit_partial(
            train_step, model, optimizer, in_shardings=(shardings, None, P("d"), P("d"))
        )
        step(X, Y)
    kernel = model.linear.kernel.get_raw_value()
    assert isinstance(kernel.sharding, NamedSharding) and kernel.sharding.spec == P()
    assert kernel.sharding.mesh.shape == mesh.shape


# ----------------------------------------------------------------------------- cached_partial
@pytest.mark.parametrize("donate", [(), (0, 1)], ids=["kept", "donated"])
def test_cached_partial_over_jit_matches_flax(donate):
    results = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model, optimizer = make()
        step = nnx.cached_partial(jit(train_step, donate_argnums=donate), model, optimizer)
        losses = [step(X, Y) for _ in range(3)]
        model.head.kernel[...] = model.head.kernel[...] * 0.5
        losses.append(step(X, Y))
        results.append((losses, state(model, optimizer)))
    assert same(*results)


def test_cached_partial_over_jit_allows_a_sow_that_is_popped():
    class Sows(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            y = self.linear(x)
            self.sow(nnx.Intermediate, "y", y)
            return y

    def f(m, x):
        y = m(x)
        return y, nnx.pop(m, nnx.Intermediate)

    outs = []
    for jit in (nnx.jit, nnx_sharding.jit):
        call = nnx.cached_partial(jit(f), Sows())
        outs.append([call(X), call(X)])
    assert same(*outs)


def test_cached_partial_over_jit_returns_its_clone_as_flax():
    def f(m, x):
        m.kernel[...] += 1.0
        return m, m(x)

    outs = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        call = nnx.cached_partial(jit(f), model)
        out, y = call(X)
        out2, _ = call(X)
        assert out is out2 and out is not model and out.kernel is model.kernel
        outs.append((y, state(model)))
    assert same(*outs)


def test_cached_partial_over_jit_with_static_and_donated_call_arguments():
    def f(model, x, scale):
        model.kernel[...] *= scale
        return model(x)

    outs = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        call = nnx.cached_partial(jit(f, static_argnums=2, donate_argnums=(0, 1)), model)
        x = X + 0.0
        outs.append(([call(x, 2.0), call(X + 0.0, 3.0), call(X + 0.0, scale=2.0)], state(model)))
        assert x.is_deleted()
    assert same(*outs)


def record(node):
    flat = nnx.to_flat_state(nnx.state(node))
    return [(p, v.get_value(), v.get_value().sharding) for p, v in flat]


def assert_unchanged(node, before):
    after = record(node)
    assert [p for p, *_ in after] == [p for p, *_ in before]
    for (_, a, sa), (_, b, sb) in zip(after, before, strict=True):
        assert a is b and sa == sb


def test_a_committed_partial_argument_on_another_sharding_is_named_and_fix_1_works():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = nnx_sharding.StateSharding({nnx.PathContains("kernel"): P(None, "model"), ...: P()})
    with jax.set_mesh(mesh):
        model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))  # committed, replicated
        before = record(model)
        step = nnx_sharding.jit_partial(lambda m, x: m(x), model, in_shardings=(rules, None))
        with pytest.raises(ValueError) as error:
            step(jnp.ones((4, 16)))
        assert str(error.value).startswith(
            "jit_partial: in_shardings: the array at partial_args[0].kernel is committed to "
        )
        assert "Fixes:\n  1. move it first" in str(error.value)
        assert_unchanged(model, before)
        nnx_sharding.shard(model, rules)  # fix 1
        assert step(jnp.ones((4, 16))).shape == (4, 64)
        assert model.kernel.get_value().sharding.spec == P(None, "model")


def test_a_partial_sharding_of_too_high_rank_is_named():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    before = record(model)
    step = nnx_sharding.jit_partial(
        lambda m, x: m(x), model, in_shardings=(P(None, None, "model"), None)
    )
    with jax.set_mesh(mesh), pytest.raises(ValueError) as error:
        step(jnp.ones((4, 16)))
    message = str(error.value)
    assert message.startswith("jit_partial: in_shardings: 2 problems:\n  - partial_args[0].bias:")
    assert "the spec needs rank at least 3, but the value has rank 1" in message
    assert_unchanged(model, before)


def test_static_argnums_0_names_the_partial_arguments_and_both_fixes_work():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    def scaled(m, n, x):
        assert isinstance(n, int)  # static: a Python int, not a tracer
        return m(x) * n

    with pytest.raises(ValueError) as error:
        nnx_sharding.jit_partial(scaled, model, static_argnums=0)
    assert str(error.value).startswith(
        "jit_partial: static_argnums: 0 is the partial arguments (all of them together), "
        "which cannot be static\nRule: "
    )
    x = jnp.ones((1, 2))
    expected = model(x) * 3
    # fix 1: without 0 (here nothing else is static)
    plain = nnx_sharding.jit_partial(lambda m, x: m(x) * 3, model)
    assert jnp.array_equal(plain(x), expected)
    # fix 2: the call's first argument counted from 1, or named
    counted = nnx_sharding.jit_partial(scaled, model, static_argnums=1)
    assert jnp.array_equal(counted(3, x), expected)
    named = nnx_sharding.jit_partial(scaled, model, static_argnames="n")
    assert jnp.array_equal(named(n=3, x=x), expected)


def test_eval_and_train_after_binding_are_not_seen_and_one_function_per_mode_matches_flax():
    def build():
        rngs = nnx.Rngs(0, dropout=1)
        model = nnx.Sequential(
            nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)
        )
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def eval_step(model, x):
        return jnp.mean(model(x) ** 2)

    x = jax.random.normal(jax.random.key(0), (16, 4))
    model, optimizer = build()  # flax's nnx.jit, switching modes: the reference
    train, evaluate = nnx.jit(train_step), nnx.jit(eval_step)
    expected = []
    for _ in range(2):
        model.train()
        expected.append(train(model, optimizer, x))
        model.eval()
        expected.append(evaluate(model, x))

    model, optimizer = build()  # bound once, modes switched after binding: not seen
    train, evaluate = (
        nnx_sharding.jit_partial(f, *a)
        for f, a in [(train_step, (model, optimizer)), (eval_step, (model,))]
    )
    stale = []
    for _ in range(2):
        model.train()
        stale.append(train(x))
        model.eval()
        stale.append(evaluate(x))
    assert not jnp.array_equal(stale[1], expected[1])  # the eval step ran in train mode

    model, optimizer = build()  # one function per mode: exactly flax's nnx.jit
    model.eval()
    evaluate = nnx_sharding.jit_partial(eval_step, model)
    model.train()
    train = nnx_sharding.jit_partial(train_step, model, optimizer)
    got = [f() for _ in range(2) for f in (lambda: train(x), lambda: evaluate(x))]
    for a, b in zip(got, expected, strict=True):
        assert jnp.array_equal(a, b)
