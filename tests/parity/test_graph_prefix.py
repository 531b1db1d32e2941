"""``nnx.prefix(node, rules, graph=True)`` under ``graph=True, graph_updates=False``.

flax takes such a prefix (its ``TreeState``: the node's graph definition and an entry per
leaf) as ``jit``'s ``in_shardings``/``out_shardings`` and ``shard_map``'s
``in_specs``/``out_specs`` in that mode, and refuses it in tree mode. Each case runs under
``flax.nnx`` and under ``nnx_sharding`` and must observe the same outputs, shardings,
Variable values and errors; flax's own cases of these forms (its ``TestJIT`` and
``TestShardMap``, the ``*_functional`` ones) are among them. The modes are arguments
here, so the ``mode`` fixture's context does not matter: each case runs once.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_nnx_prefix
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding

from ._harness import MODE, OURS, X8, Counter, mesh8, parity, run

pytestmark = [
    needs_nnx_prefix,
    pytest.mark.skipif(not hasattr(nnx, "set_graph_updates"), reason="flax without modes"),
]

NO_UPDATES = dict(graph=True, graph_updates=False)
TREE = dict(graph=False, graph_updates=False)


@pytest.fixture(autouse=True)
def _once(mode: str) -> None:
    if mode != "graph":
        pytest.skip("the modes are arguments here: one run is enough")
    assert MODE.full


def named(*spec: Any) -> NamedSharding:
    return NamedSharding(mesh8(), P(*spec))


def rules() -> dict[Any, Any]:
    """A Counter(din=4, dout=8) split over its outputs; its call count left as it is."""
    return {
        nnx.PathContains("kernel"): named(None, "x"),
        nnx.PathContains("bias"): named("x"),
        ...: None,
    }


def counter(seed: int = 0) -> Counter:
    return Counter(seed, din=4, dout=8)


def step(m: Counter, x: jax.Array) -> jax.Array:
    return m(x)  # counts the call


# 1. jit: in_shardings


def test_in_shardings_place_the_variables_and_updates_come_back():
    def scenario(impl, log):
        m = counter()
        prefix = nnx.prefix(m, rules(), graph=True)
        f = impl.jit(step, in_shardings=(prefix, named("x")), **NO_UPDATES)
        shape = f.eval_shape(m, X8)
        log.fact("eval_shape", (shape.shape, str(shape.dtype)))
        for i in range(3):
            y = f(m, X8)
            log.value(f"y{i}", y)
            log.sharding(f"y_sharding{i}", y)
            log.state(f"m{i}", m)
        compiled = f.lower(m, X8).compile()
        log.value("compiled", compiled(m, X8))
        log.state("after_compiled", m)

    parity(scenario)


@pytest.mark.parametrize(
    "static", [dict(static_argnums=(2,)), dict(static_argnames="relu")], ids=["nums", "names"]
)
def test_in_shardings_with_static_arguments(static):
    def fn(m, x, relu):
        y = m(x)
        return jnp.maximum(y, 0) if relu else y

    def scenario(impl, log):
        m = counter()
        prefix = nnx.prefix(m, rules(), graph=True)
        f = impl.jit(fn, in_shardings=(prefix, None), **static, **NO_UPDATES)
        for i in range(2):
            for relu in (True, False):
                # by position, as flax's test passes it (flax's prefix then counts it)
                log.value(f"y{i}_{relu}", f(m, X8, relu))
            log.state(f"m{i}", m)

    parity(scenario)


def test_in_shardings_of_donated_arguments():
    def scenario(impl, log):
        m = counter()
        prefix = nnx.prefix(m, rules(), graph=True)
        f = impl.jit(step, in_shardings=(prefix, None), donate_argnums=0, **NO_UPDATES)
        for i in range(2):
            log.value(f"y{i}", f(m, X8))
            log.state(f"m{i}", m)

    parity(scenario)


# 2. jit: out_shardings, the functional forms (flax's test_apply_shardings_functional and
# test_with_sharding_and_static_args_functional among them)


def test_out_shardings_lay_out_a_module_the_function_builds():
    def scenario(impl, log):
        prefix = nnx.prefix(counter(), rules(), graph=True)

        @impl.jit(out_shardings=prefix, **NO_UPDATES)
        def make():
            return counter(1)

        shapes = make.eval_shape()
        log.fact("eval_shape", (type(shapes).__name__, shapes.linear.kernel.shape))
        for i in range(2):
            m = make()
            log.state(f"m{i}", m)
            log.sharding(f"shardings{i}", nnx.state(m))

    parity(scenario)


@pytest.mark.parametrize(
    "static",
    [dict(static_argnums=(1, 2)), dict(static_argnames=("relu", "twice"))],
    ids=["nums", "names"],
)
def test_out_shardings_with_static_arguments(static):
    def scenario(impl, log):
        prefix = nnx.prefix(counter(), rules(), graph=True)

        @impl.jit(out_shardings=prefix, **static, **NO_UPDATES)
        def make(scale, relu, twice):
            m = counter(2)
            k = m.linear.kernel[...] * scale
            k = jnp.maximum(k, 0) if relu else k
            # laid out otherwise inside: out_shardings decides where it ends up
            m.linear.kernel.set_value(jax.lax.with_sharding_constraint(k * (1 + twice), named()))
            return m

        for relu, twice in [(True, False), (False, True), (True, False)]:
            m = make(0.5, relu=relu, twice=twice)
            log.state(f"m_{relu}_{twice}", m)
            log.sharding(f"shardings_{relu}_{twice}", nnx.state(m))

    parity(scenario)


def test_in_and_out_shardings_together():
    def scenario(impl, log):
        m = counter()
        prefix = nnx.prefix(m, rules(), graph=True)
        out = nnx.prefix(counter(), {...: named()}, graph=True)  # gathered

        @impl.jit(in_shardings=(prefix,), out_shardings=(out, named()), **NO_UPDATES)
        def grow(m):
            new = counter(3)
            new.linear.kernel.set_value(m.linear.kernel[...] * 2)
            m.calls[...] += 1
            return new, m.linear.bias[...]

        for i in range(2):
            new, bias = grow(m)
            log.state(f"new{i}", new)
            log.sharding(f"new_shardings{i}", nnx.state(new))
            log.value(f"bias{i}", bias)
            log.sharding(f"bias_sharding{i}", bias)
            log.state(f"m{i}", m)

    parity(scenario)


# 3. shard_map: in_specs and out_specs (flax's test_basic_shardmap_functional and
# test_simple_tensor_parallel_functional among them)


def test_shard_map_in_specs_give_each_device_its_shard():
    def scenario(impl, log):
        m = counter()
        specs = nnx.prefix(m, {nnx.PathContains("kernel"): P(None, "x"), ...: P()}, graph=True)

        @impl.shard_map(mesh=mesh8(), in_specs=(specs, P()), out_specs=P(None, "x"), **NO_UPDATES)
        def f(m, x):
            m.calls[...] += 1
            return x @ m.linear.kernel[...]

        for i in range(2):
            y = f(m, X8)
            log.value(f"y{i}", y)
            log.sharding(f"y_sharding{i}", y)
            log.state(f"m{i}", m)

    parity(scenario)


def test_shard_map_tensor_parallel_as_in_flax():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(4, 16, use_bias=False, rngs=rngs)
            self.linear2 = nnx.Linear(16, 3, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.linear2(jax.nn.relu(self.linear1(x)))

    def ends_with(*suffix):
        return lambda path, value: path[-len(suffix) :] == suffix

    def scenario(impl, log):
        m = MLP(nnx.Rngs(0))
        specs = nnx.prefix(
            m,
            {
                ends_with("linear1", "kernel"): P(None, "x"),
                ends_with("linear2", "kernel"): P("x", None),
            },
            graph=True,
        )

        @impl.shard_map(mesh=mesh8(), in_specs=(specs, P()), out_specs=P(), **NO_UPDATES)
        def f(m, x):
            return jax.lax.psum(m(x), "x")

        y = f(m, X8)
        log.value("y", y)
        log.sharding("y_sharding", y)

    parity(scenario)


def test_shard_map_out_specs_assemble_a_module_built_inside():
    class Scaled(nnx.Module):
        def __init__(self, w, b):
            self.w = nnx.Param(w)
            self.b = nnx.Param(b)

    def scenario(impl, log):
        m = Scaled(jnp.arange(32.0).reshape(4, 8), jnp.arange(8.0))
        specs = nnx.prefix(m, {nnx.PathContains("w"): P(None, "x"), ...: P("x")}, graph=True)

        @impl.shard_map(mesh=mesh8(), in_specs=(specs,), out_specs=specs, **NO_UPDATES)
        def f(m):
            return Scaled(m.w[...] * 2, m.b[...] + 1)

        for i in range(2):
            out = f(m)
            log.state(f"out{i}", out)
            log.sharding(f"out_shardings{i}", nnx.state(out))
            log.fact(f"new{i}", out is not m)
        log.state("m", m)

    parity(scenario)


# 4. shared Variables: prefixes made together, or apart


def shared_pair() -> tuple[Counter, Counter]:
    a, b = counter(0), counter(1)
    b.linear.kernel = a.linear.kernel
    return a, b


def add(a, b, x):
    return a(x) + b(x)


def test_prefixes_made_together_for_arguments_that_share_a_variable():
    def scenario(impl, log):
        a, b = shared_pair()
        pa, pb = nnx.prefix((a, b), rules(), graph=True)
        f = impl.jit(add, in_shardings=(pa, pb, None), **NO_UPDATES)
        for i in range(2):
            log.value(f"y{i}", f(a, b, X8))
            log.state(f"after{i}", a, b)
        log.fact("shared", a.linear.kernel is b.linear.kernel)

    parity(scenario)


def test_prefixes_made_apart_for_arguments_that_share_a_variable_are_refused():
    # b's prefix, made alone, holds b's kernel; in the call it is a's, shared
    def scenario(impl, log):
        a, b = shared_pair()
        pa, pb = nnx.prefix(a, rules(), graph=True), nnx.prefix(b, rules(), graph=True)
        f = impl.jit(add, in_shardings=(pa, pb, None), **NO_UPDATES)
        log.raises("call", f, a, b, X8)
        log.state("after", a, b)

    parity(scenario)
    error = run(scenario, OURS).entries[0].payload
    assert "args[1]" in str(error) and "graph definition" in str(error), str(error)


def test_shared_variable_given_another_entry_by_a_second_argument():
    def scenario(impl, log):
        a, b = shared_pair()
        pa = nnx.prefix(a, rules(), graph=True)
        f = impl.jit(add, in_shardings=(pa, named(), None), **NO_UPDATES)
        log.raises("call", f, a, b, X8)
        log.state("after", a, b)

    parity(scenario)
    error = run(scenario, OURS).entries[0].payload
    assert "Inconsistent aliasing" in str(error), str(error)
    assert "args[0].linear.kernel" in str(error) and "args[1].linear.kernel" in str(error)


def test_shared_variable_given_another_entry_by_its_path_in_a_second_argument():
    # made together, the prefix holds the kernel under `a` only; its rules give it
    # another entry by its path in `b` (flax's check asks them, for each path)
    def scenario(impl, log):
        a = counter()
        b = nnx.Dict(w=a.linear.kernel)
        pa, pb = nnx.prefix((a, b), rules(), graph=True)
        f = impl.jit(
            lambda a, b, x: a(x) + b.w[...].sum(), in_shardings=(pa, pb, None), **NO_UPDATES
        )
        log.raises("call", f, a, b, X8)
        log.state("after", a, b)

    parity(scenario)
    error = run(scenario, OURS).entries[0].payload
    assert "Inconsistent aliasing" in str(error), str(error)


# 5. a prefix made from a node of another structure


@pytest.mark.parametrize("where", ["in_shardings", "out_shardings", "in_specs", "out_specs"])
def test_prefix_of_another_structure_is_refused(where):
    other = nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(0))  # no bias

    def scenario(impl, log):
        m = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        prefix = nnx.prefix(other, {...: named() if "shardings" in where else P()}, graph=True)
        if where == "in_shardings":
            f = impl.jit(lambda m: m.kernel[...], in_shardings=(prefix,), **NO_UPDATES)
        elif where == "out_shardings":
            f = impl.jit(lambda m: nnx.clone(m), out_shardings=prefix, **NO_UPDATES)
        elif where == "in_specs":
            f = impl.shard_map(
                lambda m: m.kernel[...],
                mesh=mesh8(),
                in_specs=(prefix,),
                out_specs=P(),
                **NO_UPDATES,
            )
        else:
            f = impl.shard_map(
                lambda m: nnx.clone(m),
                mesh=mesh8(),
                in_specs=(P(),),
                out_specs=prefix,
                **NO_UPDATES,
            )
        log.raises("call", f, m)
        log.state("m", m)

    parity(scenario)
    error = str(run(scenario, OURS).entries[0].payload)
    place = "args[0]" if where.startswith("in") else "out"
    assert f"{where}: {place} has bias, which the prefix's node lacks" in error, error
    assert "pytree structure error" in error  # flax's words (jax's, in flax)


# 6. tree mode refuses it, as flax does; the fixes it gives work


@pytest.mark.parametrize("transform", ["jit", "shard_map"])
def test_tree_mode_refuses_a_graph_mode_prefix(transform):
    prefix_rules = {nnx.PathContains("kernel"): P(None, "x"), ...: P()}

    def wrap(impl, prefix, **kw):
        if transform == "jit":
            return impl.jit(lambda m: m.linear.kernel[...], in_shardings=(prefix,), **kw)
        return impl.shard_map(
            lambda m: jax.lax.psum(m.linear.kernel[...].sum(), "x"),
            mesh=mesh8(),
            in_specs=(prefix,),
            out_specs=P(),
            **kw,
        )

    def scenario(impl, log):
        prefix = nnx.prefix(counter(), prefix_rules, graph=True)
        log.raises("wrap", wrap, impl, prefix, **TREE)

    parity(scenario)
    error = str(run(scenario, OURS).entries[0].payload)
    assert "nnx.prefix(..., graph=True)` at [0]" in error, error
    # each fix, as the message gives it, works
    m = counter()
    with jax.set_mesh(mesh8()):
        expected = m.linear.kernel[...] if transform == "jit" else m.linear.kernel[...].sum()
        tree = wrap(nnx_sharding, nnx.prefix(m, prefix_rules, graph=False), **TREE)
        graph = wrap(nnx_sharding, nnx.prefix(m, prefix_rules, graph=True), **NO_UPDATES)
        full = wrap(nnx_sharding, nnx_sharding.StateSharding(prefix_rules))
        for f in (tree, graph, full):
            np.testing.assert_allclose(np.asarray(f(m)), np.asarray(expected), rtol=1e-6)
    assert "`nnx.prefix(model, rules, graph=False)`" in error
    assert "graph=True, graph_updates=False)`" in error
    assert "`nnx_sharding.StateSharding(rules)`" in error


def test_graph_node_as_a_prefix_names_the_graph_mode_prefix_as_a_fix():
    m = counter()
    with pytest.raises(ValueError, match="Graph nodes are not allowed") as raised:
        nnx_sharding.jit(step, in_shardings=(nnx.prefix(m, rules(), graph=False),), **NO_UPDATES)
    assert "`nnx.prefix(model, rules, graph=True)`" in str(raised.value)
    f = nnx_sharding.jit(
        step, in_shardings=(nnx.prefix(m, rules(), graph=True), None), **NO_UPDATES
    )
    expected = nnx.clone(m)(X8)
    np.testing.assert_allclose(np.asarray(f(m, X8)), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert int(m.calls[...]) == 1
