"""Composition with flax's other transforms, in both nestings, and with jax's.

Each scenario calls the jitted function three times (our first call takes the full
path, the others the fast path) and logs the outputs and the caller's state.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import errors as flax_errors
from flax import nnx

from ._harness import (
    EAGER,
    FLAX,
    MODE,
    OURS,
    Block,
    Counter,
    Pair,
    X,
    compare,
    mse,
    parity,
    run,
    sgd,
    stack,
)


class Duo(nnx.Module):
    """Two counters and a call count (Pair without the BatchNorm)."""

    def __init__(self):
        self.a = Counter(0)
        self.b = Counter(1)
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.b(nnx.relu(self.a(x)))


XS = jnp.stack([X, -X, 2 * X])  # a batch of 3 inputs, for vmap and scan


class Plain(nnx.Module):
    """Two Linear layers and nothing that a call updates."""

    def __init__(self):
        self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


# 1. flax's autodiff inside our jit


def grad_step(m, x):
    grads = nnx.grad(mse)(m, x)
    sgd(m, grads)
    return grads


def value_and_grad_step(m, x):
    loss, grads = nnx.value_and_grad(mse)(m, x)
    sgd(m, grads)
    return loss


def has_aux_step(m, x):
    def loss_fn(m, x):
        y = m(x)
        return jnp.mean(y**2), {"calls": m.calls[...], "y": y}

    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m, x)
    sgd(m, grads)
    return loss, aux


def argnums_step(m, x):
    grads = nnx.grad(lambda a, b, x: jnp.mean(b(a(x)) ** 2), argnums=(0, 1))(m.a, m.b, x)
    sgd(m.a, grads[0])
    sgd(m.b, grads[1], lr=0.2)
    return grads


def diff_state_step(m, x):
    only_a = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("a")))
    grads = nnx.grad(mse, argnums=only_a)(m, x)
    nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, only_a.filter), grads))
    return grads


def functional_grad_step(m, x):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    loss_fn = lambda p: mse(nnx.merge(graphdef, p, rest), x)  # noqa: E731
    grads = jax.grad(loss_fn)(params)
    nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return grads


def remat_step(m, x):
    loss, grads = nnx.value_and_grad(nnx.remat(mse))(m, x)
    sgd(m, grads)
    return loss


STEPS_INSIDE = {
    "grad": grad_step,
    "value_and_grad": value_and_grad_step,
    "has_aux": has_aux_step,
    "argnums": argnums_step,
    "DiffState": diff_state_step,
    "jax.grad_of_split": functional_grad_step,
    "remat_in_grad": remat_step,
}


@pytest.mark.parametrize("step", STEPS_INSIDE.values(), ids=STEPS_INSIDE.keys())
def test_autodiff_inside_jit(step):
    def scenario(impl, log):
        # jax.grad over a split state needs a model that is not updated in the loss
        model = Plain() if step is functional_grad_step else Pair()
        f = impl.jit(step)
        for i in range(3):
            log.value(f"out{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


# 2. our jit inside flax's (and jax's) autodiff


def test_grad_of_jitted_loss_updates_the_model_between_calls():
    def scenario(impl, log):
        model = Counter()
        loss = impl.jit(mse)
        for i in range(3):
            grads = nnx.grad(loss)(model, X)
            log.value(f"grads{i}", grads)
            sgd(model, grads)
        log.state("model", model)

    parity(scenario)


def test_value_and_grad_of_jitted_loss_with_aux_and_counter():
    def loss_fn(m, x):
        m.calls[...] += 10  # a BatchStat update inside jit inside grad reaches the caller
        y = m(x)
        return jnp.mean(y**2), y

    def scenario(impl, log):
        model = Pair()
        f = nnx.value_and_grad(impl.jit(loss_fn), has_aux=True)
        for i in range(3):
            (loss, y), grads = f(model, X)
            log.value(f"out{i}", (loss, y, grads))
            sgd(model, grads)
        log.state("model", model)

    parity(scenario)


def test_jax_grad_of_split_state_through_jitted_loss():
    def scenario(impl, log):
        model = Plain()
        loss = impl.jit(mse)
        for i in range(3):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            grads = jax.grad(lambda p, g=graphdef, r=rest: loss(nnx.merge(g, p, r), X))(params)
            log.value(f"grads{i}", grads)
            sgd(model, grads)
        log.state("model", model)

    parity(scenario)


def test_jitted_function_inside_remat():
    def forward(m, x):
        return jnp.sin(m(x))

    def scenario(impl, log):
        model = Counter()
        f = nnx.remat(impl.jit(forward))
        for i in range(3):
            log.value(f"out{i}", f(model, X))
            log.value(f"grad{i}", nnx.grad(lambda m: f(m, X).sum())(model))
        log.state("model", model)

    parity(scenario)


# 3. vmap and scan


def vmap_batch(m, xs):
    return nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m.linear, xs)


def vmap_ensemble(layers, x):
    # each member counts its own calls (the count is stacked too)
    return nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))(layers, x)


def vmap_dropout_state_axes(model, xs):
    state_axes = nnx.StateAxes({"dropout": 0, ...: None})

    @nnx.split_rngs(splits=3, only="dropout")
    @nnx.vmap(in_axes=(state_axes, 0), out_axes=0)
    def forward(model, x):
        return model(x)

    return forward(model, xs)


def scan_over_layers(layers, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(layer, x):
        return layer(x)

    return forward(layers, x)


def scan_carry_module(m, xs):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(m, x):
        y = m(x)
        m.linear.bias[...] += 0.1 * y.mean(0)
        return m, y

    _, ys = body(m, xs)
    return ys


def make_block():
    return Block(nnx.Rngs(0, dropout=1))


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return jnp.tanh(self.linear(x))


def counters():
    """Three Layers stacked on a leading axis (no Dropout: cheap under eager vmap)."""

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Layer(rngs)

    return create(nnx.Rngs(0))


INSIDE = {
    "vmap_batch": (Counter, vmap_batch, XS),
    "vmap_ensemble": (counters, vmap_ensemble, X),
    "split_rngs_StateAxes": (make_block, vmap_dropout_state_axes, XS),
    "scan_over_layers": (stack, scan_over_layers, X),
    "scan_carry_module": (Counter, scan_carry_module, XS),
}


@pytest.mark.parametrize("make, fn, x", INSIDE.values(), ids=INSIDE.keys())
def test_vmap_and_scan_inside_jit(make, fn, x):
    def scenario(impl, log):
        model = make()
        f = impl.jit(fn)
        for i in range(3):
            log.value(f"out{i}", f(model, x))
        log.state("model", model)

    parity(scenario)


def test_split_rngs_and_vmap_create_an_ensemble_inside_jit():
    def create(rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        return make(rngs)

    def scenario(impl, log):
        rngs = nnx.Rngs(0, dropout=1)
        f = impl.jit(create)
        for i in range(3):
            log.value(f"ensemble{i}", f(rngs))
        log.state("rngs", rngs)

    parity(scenario)


def test_jitted_function_inside_vmap_broadcast_module():
    def scenario(impl, log):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        f = nnx.vmap(impl.jit(lambda m, x: m(x)), in_axes=(None, 0))
        for i in range(3):
            log.value(f"out{i}", f(model, XS * (i + 1)))
        log.state("model", model)

    parity(scenario)


def test_jitted_function_inside_vmap_over_stacked_layers():
    def scenario(impl, log):
        layers = counters()
        f = nnx.vmap(impl.jit(lambda layer, x: layer(x)), in_axes=(0, None))
        for i in range(3):
            log.value(f"out{i}", f(layers, X))
        log.state("layers", layers)

    parity(scenario)


def test_jitted_layer_inside_scan_body():
    def scenario(impl, log):
        layers = counters()
        layer_fn = impl.jit(lambda layer, x: layer(x))

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def forward(layer, x):
            return layer_fn(layer, x)

        for i in range(3):
            log.value(f"out{i}", forward(layers, X))
        log.state("layers", layers)

    parity(scenario)


# 4. control flow: cond, switch, fori_loop, while_loop


def cond_inside(m, x):
    return nnx.cond(x.sum() > 0, lambda m, x: m.a(x), lambda m, x: m.b(x) * 2, m, x)


def switch_inside(m, x, i):
    branches = [lambda m, x: m.a(x), lambda m, x: m.b(x), lambda m, x: m(x)]
    return nnx.switch(i, branches, m, x)


def fori_inside(m, x):
    def body(i, m):
        sgd(m, nnx.grad(mse)(m, x * i))
        return m

    nnx.fori_loop(0, 3, body, m)
    return mse(m, x)


def while_inside(m, x):
    def body(carry):
        m, n = carry
        sgd(m, nnx.grad(mse)(m, x))
        return m, n + 1

    _, n = nnx.while_loop(lambda c: c[1] < 3, body, (m, jnp.array(0)))
    return n, mse(m, x)


def test_cond_inside_jit_alternating_branches():
    def scenario(impl, log):
        model = Duo()
        f = impl.jit(cond_inside)
        for i, x in enumerate([X, -X, X, -X]):
            log.value(f"out{i}", f(model, x))
        log.state("model", model)

    parity(scenario)


def test_switch_inside_jit_over_every_branch():
    def scenario(impl, log):
        model = Duo()
        f = impl.jit(switch_inside)
        for i in [0, 1, 2, 1]:
            log.value(f"out{i}", f(model, X, jnp.array(i)))
        log.state("model", model)

    parity(scenario)


@pytest.mark.parametrize("fn", [fori_inside, while_inside], ids=["fori_loop", "while_loop"])
def test_loop_inside_jit(fn):
    def scenario(impl, log):
        model = Duo()
        f = impl.jit(fn)
        for i in range(3):
            log.value(f"out{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


def test_jitted_branches_inside_cond():
    def scenario(impl, log):
        model = Duo()
        a = impl.jit(lambda m, x: m.a(x))
        b = impl.jit(lambda m, x: m.b(x) * 2)
        for i, pred in enumerate([True, False, True, False]):
            log.value(f"out{i}", nnx.cond(pred, a, b, model, X))
        log.state("model", model)

    parity(scenario)


def test_jitted_branches_inside_switch():
    def scenario(impl, log):
        model = Duo()
        branches = [impl.jit(lambda m, x: m.a(x)), impl.jit(lambda m, x: m.b(x))]
        for i, index in enumerate([0, 1, 0, 1]):
            log.value(f"out{i}", nnx.switch(index, branches, model, X))
        log.state("model", model)

    parity(scenario)


def test_jitted_body_inside_fori_loop():
    def scenario(impl, log):
        model = Counter()
        step = impl.jit(grad_step)

        def body(i, m):
            step(m, X)
            return m

        for i in range(3):
            nnx.fori_loop(0, 2, body, model)
            log.value(f"loss{i}", mse(model, X))
        log.state("model", model)

    parity(scenario)


def test_jitted_body_inside_while_loop():
    def scenario(impl, log):
        model = Counter()
        step = impl.jit(value_and_grad_step)

        def body(carry):
            m, n, loss = carry
            return m, n + 1, step(m, X)

        for i in range(3):
            _, n, loss = nnx.while_loop(lambda c: c[1] < 2, body, (model, 0, jnp.array(0.0)))
            log.value(f"out{i}", (n, loss))
        log.state("model", model)

    parity(scenario)


# 5. our jit inside jax.jit, inside flax's nnx.jit, and around flax's


def test_inside_jax_jit_module_as_pytree_argument():
    def scenario(impl, log):
        model = Duo()
        inner = impl.jit(lambda m, x: m(x) * 2)
        outer = jax.jit(lambda m, x: inner(m, x))
        for i in range(3):
            log.value(f"out{i}", outer(model, X + i))
        log.state("model", model)  # jax.jit's module is a copy: the caller's is unchanged

    parity(scenario)


def test_inside_jax_jit_returning_the_updated_module():
    def scenario(impl, log):
        model = Duo()
        inner = impl.jit(lambda m, x: m(x))

        @jax.jit
        def outer(m, x):
            y = inner(m, x)
            return m, y

        for i in range(3):
            new, y = outer(model, X)
            log.value(f"out{i}", (new, y))
            log.fact(f"new is model {i}", new is model)
            nnx.update(model, nnx.state(new))
        log.state("model", model)

    parity(scenario)


def test_inside_jax_jit_functional_split_merge():
    def scenario(impl, log):
        model = Duo()
        graphdef, state = nnx.split(model)
        inner = impl.jit(lambda m, x: m(x))

        @jax.jit
        def outer(state, x):
            m = nnx.merge(graphdef, state)
            y = inner(m, x)
            return nnx.state(m), y

        for i in range(3):
            state, y = outer(state, X)
            log.value(f"out{i}", (state, y))
        nnx.update(model, state)
        log.state("model", model)

    parity(scenario)


CLOSURES = {
    "jax.jit": lambda f: jax.jit(f),
    "jax.grad": lambda f: jax.grad(lambda x: f(x).sum()),
    "jax.vmap": lambda f: jax.vmap(f),
}


@pytest.mark.parametrize("outer", CLOSURES.values(), ids=CLOSURES.keys())
def test_read_only_call_under_jax_transform_over_closed_over_module(outer):
    # flax writes every Variable back after the call, also unchanged ones: under an outer
    # jax transform the values are tracers of that trace, and flax raises TraceContextError
    # (and leaves the module emptied, so each call here gets a fresh one).
    def scenario(impl, log):
        inner = impl.jit(lambda m, x: jnp.sin(m(x)))
        for i in range(3):
            model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            log.raises(f"call{i}", outer(lambda x, m=model: inner(m, x)), XS[i])

    parity(scenario)


@pytest.mark.parametrize("outer", CLOSURES.values(), ids=CLOSURES.keys())
def test_read_only_call_under_jax_transform_leaves_the_module_usable(outer):
    # ours raises flax's error too, but writes nothing: the same module can be called again
    # (and raises again), and works outside the outer transform (issue 15, A.7)
    if not MODE.full:  # nothing changed, so nothing is written back: no error, as flax

        def scenario(impl, log):
            model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            inner = impl.jit(lambda m, x: jnp.sin(m(x)))
            for i in range(3):
                log.raises(f"call{i}", outer(lambda x: inner(model, x)), XS[i])
            log.state("model", model)

        parity(scenario)
        return
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    before = jax.tree.map(lambda x: x.copy(), nnx.state(model))
    inner = OURS.jit(lambda m, x: jnp.sin(m(x)))
    for i in range(3):
        with pytest.raises(flax_errors.TraceContextError):
            outer(lambda x: inner(model, x))(XS[i])
        after = nnx.state(model)
        assert jax.tree.structure(after) == jax.tree.structure(before)
        assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, after, before)))
    expected = jnp.sin(nnx.merge(*nnx.split(model))(X))
    assert jnp.allclose(inner(model, X), expected)


def counting_step(m, x):
    m.calls[...] += 1
    return m(x)


NESTINGS = {
    "ours_in_flax": lambda impl: (nnx.jit, impl.jit),
    "flax_in_ours": lambda impl: (impl.jit, nnx.jit),
    "ours_in_ours": lambda impl: (impl.jit, impl.jit),
}


@pytest.mark.parametrize("nesting", NESTINGS.values(), ids=NESTINGS.keys())
def test_nested_jit_updates_reach_the_caller(nesting):
    def scenario(impl, log):
        outer_jit, inner_jit = nesting(impl)
        model = Duo()
        inner = inner_jit(counting_step)

        @outer_jit
        def outer(m, x):
            y = inner(m, x)
            return m, inner(m, y)

        for i in range(3):
            out, y = outer(model, X)
            log.fact(f"out is model {i}", out is model)
            log.value(f"y{i}", y)
        log.state("model", model)

    parity(scenario)


@pytest.mark.parametrize("nesting", NESTINGS.values(), ids=NESTINGS.keys())
def test_nested_jit_structure_change_inside_the_inner_call(nesting):
    def grow(m, x):
        m.calls[...] += 1
        if not hasattr(m, "extra"):
            m.extra = nnx.Param(jnp.ones(2))
        else:
            m.extra[...] += 1.0
        return m(x) + m.extra[...]

    def scenario(impl, log):
        outer_jit, inner_jit = nesting(impl)
        model = Duo()
        inner = inner_jit(grow)
        outer = outer_jit(lambda m, x: inner(m, x) * 2)
        for i in range(3):
            log.value(f"out{i}", outer(model, X))
            log.state(f"model{i}", model)

    parity(scenario)


@pytest.mark.parametrize("nesting", NESTINGS.values(), ids=NESTINGS.keys())
def test_nested_jit_shared_submodule_and_returned_inputs(nesting):
    def scenario(impl, log):
        outer_jit, inner_jit = nesting(impl)
        model = Duo()
        model.alias = model.a  # shared
        inner = inner_jit(lambda a, m, x: (m, a, a(x) + m.alias(x)))

        @outer_jit
        def outer(m, x):
            got_m, got_a, y = inner(m.a, m, x)
            assert got_m is m and got_a is m.a and m.alias is m.a
            return got_m, got_a, y

        for i in range(3):
            m, a, y = outer(model, X)
            log.fact(f"identities{i}", (m is model, a is model.a, model.alias is model.a))
            log.value(f"y{i}", y)
        log.state("model", model)

    parity(scenario)


# 6. a failure inside our jit under jax.jit/jax.grad over a closed-over module.
# flax raises TraceContextError (the update cannot be written from another trace level)
# and leaves the module without the updated attribute; nnx_sharding promises to raise the
# same error and leave the caller's module intact (issue 15, A.7). Compared with the eager
# run (no jit at all), which raises the same error before touching anything.

OUTER = {
    "jax.jit": lambda f: jax.jit(f),
    "jax.grad": lambda f: jax.grad(lambda x: f(x).sum()),
}


@pytest.mark.parametrize("outer", OUTER.values(), ids=OUTER.keys())
def test_failure_under_outer_trace_leaves_the_closed_over_module_intact(outer):
    def scenario(impl, log):
        model = Duo()
        step = impl.jit(counting_step)
        for i in range(3):
            log.raises(f"call{i}", outer(lambda x: step(model, x)), X)
            log.state(f"model{i}", model)
            log.value(f"eager{i}", model.a.linear(X))

    flax_log = run(scenario, FLAX)
    errors = [e.payload for e in flax_log.entries if e.kind == "error"]
    assert errors and all(isinstance(e, flax_errors.TraceContextError) for e in errors)
    eager = run(scenario, EAGER)
    assert eager.escaped is None, eager.trace
    ours = run(scenario, OURS)
    problems = compare(eager, ours)
    assert not problems, "\n".join(problems)


# 7. a jitted function built from flax's transforms wrapped once more


def test_jit_of_vmapped_and_remat_forward_with_grad():
    @functools.partial(nnx.vmap, in_axes=(None, 0))
    @nnx.remat
    def forward(m, x):
        return jnp.tanh(m(x))

    def step(m, xs):
        loss, grads = nnx.value_and_grad(lambda m: forward(m, xs).mean())(m)
        sgd(m, grads)
        return loss

    def scenario(impl, log):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        f = impl.jit(step)
        for i in range(3):
            log.value(f"loss{i}", f(model, XS))
        log.state("model", model)

    parity(scenario)
