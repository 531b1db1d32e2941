"""The shared call path (`call`): outer jax transforms, ``nnx.cached_partial``,
bound methods and static arguments, and failures that must leave objects intact."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import errors, nnx
from jax.sharding import PartitionSpec as P

import nnx_sharding

X = jnp.ones((1, 2))


def _state(module):
    return nnx.to_pure_dict(nnx.state(module))


def _same(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


@pytest.mark.parametrize("warm_calls", [0, 2], ids=["cold", "warm"])
@pytest.mark.parametrize("outer", ["grad", "jit"])
def test_inside_an_outer_jax_transform_over_a_closed_over_module(warm_calls, outer):
    """As in flax, the call cannot write back into a module the outer transform closes
    over: a TraceContextError, raised before anything is written."""
    outcomes = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        before = _state(model)
        f = jit(lambda m, x: m(x))
        for _ in range(warm_calls):
            f(model, X)
        loss = lambda x: f(model, x).sum()  # noqa: B023 - called right away
        with pytest.raises(errors.TraceContextError) as info:
            jax.grad(loss)(X) if outer == "grad" else jax.jit(loss)(X)
        outcomes.append((model, before, str(info.value)))
    (flax_model, _, _), (ours, before, message) = outcomes
    assert "Cannot mutate" in message and "args[0].kernel" in message
    assert "nnx.grad" in message  # the fix
    assert _same(_state(ours), before)  # flax leaves its module empty; ours is intact
    assert not hasattr(flax_model, "kernel")
    assert jnp.allclose(ours(X), nnx.Linear(2, 2, rngs=nnx.Rngs(0))(X))


def test_inside_flax_transforms_that_pass_the_module_the_call_writes_back():
    """Under flax's nnx.jit and nnx.grad the module is an argument: our call's update
    (BatchNorm statistics) is written back as flax's own nnx.jit writes it."""
    results = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        f = jit(lambda m, x: m(x))

        @nnx.jit
        def outer(m, x):
            return nnx.grad(lambda m: (f(m, x) ** 2).sum())(m)  # noqa: B023

        grads = [outer(model, X * k) for k in (1.0, 2.0, 3.0)]
        results.append((_state(grads[-1]), _state(model)))
    assert _same(results[0], results[1])
    assert not jnp.allclose(results[1][1]["mean"], 0.0)  # the statistics were written


def _step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("jit", [nnx.jit, nnx_sharding.jit], ids=["flax", "ours"])
def test_cached_partial_trains_like_a_plain_call(jit):
    results = []
    for cached in (False, True):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = jit(_step)
        call = nnx.cached_partial(step, model, optimizer) if cached else None
        losses = [call(X) if cached else step(model, optimizer, X) for _ in range(3)]
        results.append((losses, _state(model), _state(optimizer)))
    assert _same(results[0], results[1])
    assert results[1][0][0] > results[1][0][2]  # it trained


def test_cached_partial_flattens_its_clones_once(monkeypatch):
    """Under ``nnx.cached_partial`` the cached clones are flattened once, as jit_partial
    flattens (`cached_partial`): no call walks the graphs (`split_call`)."""
    from nnx_sharding._callpath import call as _call
    from nnx_sharding._jit_partial import cached_partial as _cached_partial

    splits, partials = [], []
    original = _call.split_call
    monkeypatch.setattr(_call, "split_call", lambda *a: splits.append(1) or original(*a))
    made = _cached_partial.JitPartialWrapped
    monkeypatch.setattr(
        _cached_partial, "JitPartialWrapped", lambda *a, **k: partials.append(1) or made(*a, **k)
    )
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    call = nnx.cached_partial(nnx_sharding.jit(_step), model, optimizer)
    for _ in range(4):
        call(X)
    assert len(splits) == 0 and len(partials) == 1
    # a graph node among the other arguments: jit's path (split once, then the fast path)
    step = nnx_sharding.jit(lambda model, optimizer, x: _step(model, optimizer, x))
    call = nnx.cached_partial(step, model)
    for _ in range(4):
        call(optimizer, X)
    assert len(splits) == 1 and len(partials) == 1


@pytest.mark.parametrize("case", ["sharded", "one clone of two donated"])
def test_cached_partial_takes_the_full_path_where_jit_partial_cannot(monkeypatch, case):
    """Shardings, and clones donated apart, keep jit's path, and give flax's results."""
    from nnx_sharding._jit_partial import cached_partial as _cached_partial

    partials = []
    made = _cached_partial.JitPartialWrapped
    monkeypatch.setattr(
        _cached_partial, "JitPartialWrapped", lambda *a, **k: partials.append(1) or made(*a, **k)
    )

    def f(model, x):
        model.kernel[...] += 1.0
        return model(x)

    outs = []
    for jit in (nnx.jit, nnx_sharding.jit):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        if case == "sharded":
            call = nnx.cached_partial(jit(f, in_shardings=(None, None)), model)
            outs.append(([call(X), call(X)], _state(model)))
        else:
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
            call = nnx.cached_partial(jit(_step, donate_argnums=1), model, optimizer)
            outs.append(([call(X), call(X)], _state(model), _state(optimizer)))
    assert _same(*outs)
    assert partials == []


@pytest.mark.parametrize("donate", [(), (0,)], ids=["kept", "donated"])
def test_cached_partial_of_a_plain_array_attribute_fails_before_anything_runs(donate):
    """flax's cached_partial fails on an array outside a Variable (AttributeError); ours
    names it, before the program runs, leaving the model as it was."""

    def f(m, x):
        m.kernel[...] += 1.0
        return m(x) + m.offset

    with pytest.raises(AttributeError, match="has no attribute 'get_raw_value'"):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        model.offset = jnp.ones(2)
        nnx.cached_partial(nnx.jit(f, donate_argnums=donate), model)(X)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    model.offset = jnp.ones(2)
    before = _state(model)
    call = nnx.cached_partial(nnx_sharding.jit(f, donate_argnums=donate), model)
    for _ in range(2):  # and again: nothing was cached
        with pytest.raises(TypeError) as info:
            call(X)
        assert str(info.value).startswith(
            "jit: args: an array outside a Variable at args[0].offset"
        ), str(info.value)
    assert _same(before, _state(model))
    assert not model.kernel.get_raw_value().is_deleted()


def test_a_bound_method_passes_its_module_as_an_argument():
    """flax rejects ``nnx.jit(m.__call__)``; here the module is an argument, so an
    update between calls is used (it is not baked into the program)."""
    with pytest.raises(ValueError, match="bound methods"):
        nnx.jit(nnx.Linear(2, 2, rngs=nnx.Rngs(0)).__call__)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    forward = nnx_sharding.jit(model.__call__)
    forward(X)
    model.kernel[...] = model.kernel[...] * 2
    assert jnp.allclose(forward(X), model(X))
    model.kernel = nnx.Param(jnp.ones((2, 2)))  # a new Variable: a new structure
    assert jnp.allclose(forward(X), model(X))


@pytest.mark.skipif(not hasattr(nnx, "set_graph_updates"), reason="flax without graph_updates")
@pytest.mark.parametrize("mode", [{"graph": False}, {"graph_updates": False}], ids=str)
def test_on_the_simple_path_a_bound_method_of_a_module_is_refused_as_in_flax(mode):
    """flax's simple path refuses a module's bound method (the module is no argument);
    so do ours, naming its type. A method bound to an object that is not a graph node
    is an ordinary function."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = {"mesh": mesh, "in_specs": (P(),), "out_specs": P()}
    with pytest.raises(ValueError, match="bound methods"):
        nnx.jit(model.__call__, **mode)
    with pytest.raises(ValueError, match=r"^jit: fun: a bound method of a graph node \(Linear\)"):
        nnx_sharding.jit(model.__call__, **mode)
    with pytest.raises(ValueError, match="bound methods"):
        nnx.shard_map(model.__call__, **specs, **mode)
    with pytest.raises(ValueError, match=r"^shard_map: f: a bound method of a graph node \(Lin"):
        nnx_sharding.shard_map(model.__call__, **specs, **mode)

    class Plain:
        def double(self, x):
            return 2 * x

    assert nnx_sharding.jit(Plain().double, **mode)(X).tolist() == (2 * X).tolist()
    got = nnx_sharding.shard_map(Plain().double, **specs, **mode)(X)
    assert got.tolist() == nnx.shard_map(Plain().double, **specs, **mode)(X).tolist()


class Scaler(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))

    def apply(self, x, power):
        self.w[...] += 1
        return self.w[...] ** power * x


def test_a_bound_method_counts_static_argnums_from_its_first_argument():
    scaler = Scaler()
    apply = nnx_sharding.jit(scaler.apply, static_argnums=1)
    assert apply(jnp.ones(2), 2).tolist() == [4.0, 4.0]
    assert apply(jnp.ones(2), 3).tolist() == [27.0, 27.0]
    assert scaler.w[...].tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    "options, call",
    [
        (dict(static_argnums=0), lambda f, m: f(m, X)),
        (dict(static_argnames="m"), lambda f, m: f(m=m, x=X)),
        (dict(static_argnums=0), lambda f, m: f((m.kernel,), X)),
    ],
    ids=["module", "by-name", "variable-in-tuple"],
)
def test_a_graph_node_as_a_static_argument_is_refused(options, call):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = nnx_sharding.jit(lambda m, x: x, **options)
    with pytest.raises(ValueError, match=r"jit: (args\[0\]|kwargs\['m'\]): a graph node") as info:
        call(f, model)
    assert "drop it from static_argnums" in str(info.value)
    with pytest.raises(ValueError):  # flax refuses it too (as unhashable)
        call(nnx.jit(lambda m, x: x, **options), model)


@pytest.mark.parametrize("warm_calls", [0, 2], ids=["cold", "warm"])
def test_a_failure_inside_an_outer_jit_leaves_the_module_intact(warm_calls):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = _state(model)

    def bad(m, x):
        m.kernel[...] = m.kernel[...] * 0
        if warm_calls and isinstance(x, jax.core.Tracer) and x.ndim == 2 and x.shape[0] == 3:
            raise RuntimeError("boom")
        return m(x)

    f = nnx_sharding.jit(bad)
    for _ in range(warm_calls):
        f(nnx.Linear(2, 2, rngs=nnx.Rngs(1)), X)
    with pytest.raises((RuntimeError, errors.TraceContextError)):
        jax.jit(lambda x: f(model, x))(jnp.ones((3, 2)))
    assert _same(_state(model), before)
