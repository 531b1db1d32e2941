"""flax's tree mode and ``graph_updates=False``, given explicitly to ``jit``/``shard_map``.

The cases of flax's own tests of these modes (its TestJIT, TestTreeJIT, TestEvalShape and
TestShardMap), rewritten as differential scenarios: each runs under ``flax.nnx`` and
under ``nnx_sharding`` with the same ``graph``/``graph_updates`` and must observe the
same outputs, Variable values, identities, trace counts and errors. ``MODES`` here are
the simple path's: graph mode without graph updates, and tree mode (``graph=False``,
with either ``graph_updates``). The modes are given as arguments, so the context the
``mode`` fixture sets does not matter: each case runs once.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_sharding

from ._harness import MODE, X8, Counter, X, mesh8, parity

pytestmark = pytest.mark.skipif(
    not hasattr(nnx, "set_graph_updates"), reason="flax without graph_updates"
)

MODES = {
    "no_updates": dict(graph=True, graph_updates=False),
    "tree": dict(graph=False, graph_updates=False),
    "tree_updates": dict(graph=False, graph_updates=True),  # graph_updates has no effect
}
modes = pytest.mark.parametrize("kw", list(MODES.values()), ids=list(MODES))


@pytest.fixture(autouse=True)
def _once(mode: str) -> None:
    if mode != "graph":
        pytest.skip("the modes are arguments here: one run is enough")
    assert MODE.full


class Pair(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.array(1.0))
        self.b = nnx.Param(jnp.array(2.0))


class Holder(nnx.Module):
    def __init__(self, seed: int = 0):
        self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
        self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(seed + 1))


def traced(log: Any) -> Any:
    """A counter of traces, logged with ``log.fact``."""
    count = [0]

    def bump() -> None:
        count[0] += 1

    bump.log = lambda label: log.fact(label, count[0])  # type: ignore[attr-defined]
    return bump


# 1. calls, updates and traces


@modes
def test_variable_update_and_python_output(kw):
    def scenario(impl, log):
        m = nnx.Dict(a=nnx.Param(jnp.array(1)))

        @impl.jit(**kw)
        def g(m):
            m.a[...] = 2
            return 1.0

        for i in range(3):
            log.value(f"out{i}", g(m))
            log.state(f"m{i}", m)

    parity(scenario)


@modes
def test_module_forward_traces_once(kw):
    def scenario(impl, log):
        m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        count = traced(log)

        @impl.jit(**kw)
        def f(m, x):
            count()
            return m(x)

        for i in range(3):
            log.value(f"y{i}", f(m, X))
            count.log(f"traces{i}")
        log.state("m", m)

    parity(scenario)


@modes
def test_decorated_method_counts_its_calls(kw):
    def scenario(impl, log):
        class Foo(nnx.Module):
            def __init__(self):
                self.count = nnx.Variable(jnp.array(0))
                self.w = nnx.Param(jnp.ones((2, 3)))

            @impl.jit(**kw)
            def __call__(self, x):
                self.count[...] += 1
                return x @ self.w[...]

        m = Foo()
        for i in range(3):
            log.value(f"y{i}", m(X))
            log.state(f"m{i}", m)

    parity(scenario)


@modes
def test_values_swapped_with_set_value_keep_identities_and_the_trace(kw):
    def scenario(impl, log):
        count = traced(log)

        @impl.jit(**kw)
        def swap(m):
            count()
            a, b = m.a.get_value(), m.b.get_value()
            m.a.set_value(b)
            m.b.set_value(a)

        m = Pair()
        a, b = m.a, m.b
        for i in range(3):
            swap(m)
            log.fact(f"same{i}", (m.a is a, m.b is b))
            log.value(f"values{i}", (m.a[...], m.b[...]))
            count.log(f"traces{i}")

    parity(scenario)


@modes
def test_submodules_swapped_inside_are_not_swapped_outside(kw):
    def scenario(impl, log):
        count = traced(log)

        @impl.jit(**kw)
        def f(tree):
            count()
            m = tree[0]["foo"]
            m.a, m.b = m.b, m.a

        m = Holder()
        a, b = m.a, m.b
        for i in range(3):
            f(({"foo": m},))
            log.fact(f"same{i}", (m.a is a, m.b is b))
            count.log(f"traces{i}")
        log.state("m", m)

    parity(scenario)


@modes
def test_new_attribute_inside_is_not_added(kw):
    def scenario(impl, log):
        @impl.jit(**kw)
        def f(m):
            m.calls[...] += 1
            m.extra = nnx.Param(jnp.ones(()))
            return m.calls[...]

        m = Counter()
        for i in range(3):
            log.value(f"out{i}", f(m))
            log.fact(f"extra{i}", hasattr(m, "extra"))
        log.state("m", m)

    parity(scenario)


@modes
def test_module_returned_is_a_new_object_with_the_new_values(kw):
    def scenario(impl, log):
        @impl.jit(**kw)
        def f(x):
            m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            m.kernel[...] = m.kernel[...] * x
            return m

        for i in range(3):
            out = f(jnp.array(2.0))
            log.fact(f"type{i}", type(out).__name__)
            log.state(f"out{i}", out)

    parity(scenario)


@modes
def test_new_variable_returned(kw):
    def scenario(impl, log):
        f = impl.jit(lambda x: nnx.Param(x + 1), **kw)
        for i in range(3):
            v = f(jnp.array(1.0))
            log.fact(f"type{i}", type(v).__name__)
            log.value(f"v{i}", v[...])

    parity(scenario)


# 2. aliasing


@modes
def test_input_variable_returned(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))
        f = impl.jit(lambda v: v, **kw)
        for i in range(3):
            log.raises(f"call{i}", f, v)
        log.value("v", v[...])

    parity(scenario)


@modes
def test_input_module_returned(kw):
    def scenario(impl, log):
        m = Counter()

        @impl.jit(**kw)
        def f(m, x):
            m(x)
            return m

        for i in range(3):
            out = log.raises(f"call{i}", f, m, X)
            log.fact(f"same{i}", out is m)
        log.state("m", m)

    parity(scenario)


@modes
def test_same_variable_twice(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))

        @impl.jit(**kw)
        def f(v1, v2):
            v1[...] += 1.0
            return v2[...]

        for i in range(3):
            log.raises(f"call{i}", f, v, v)
        log.value("v", v[...])

    parity(scenario)


@modes
def test_variable_shared_by_two_modules(kw):
    def scenario(impl, log):
        a, b = Counter(0), Counter(1)
        b.linear.kernel = a.linear.kernel

        @impl.jit(**kw)
        def f(a, b, x):
            a.linear.kernel[...] += 1.0
            return b(x)

        for i in range(3):
            log.raises(f"call{i}", f, a, b, X)
        log.state("after", a, b)
        log.fact("shared", a.linear.kernel is b.linear.kernel)

    parity(scenario)


@modes
@pytest.mark.parametrize("case", ["input_returned", "same_variable_twice", "module_returned"])
def test_eval_shape_refuses_what_the_call_refuses(kw, case):
    # flax's TestEvalShape cases (no_input_output_aliasing, no_shared_variable_refs),
    # through jit(...).eval_shape: flax's nnx.jit(...).eval_shape is the reference
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))
        m = Counter()
        if case == "input_returned":
            f, args = impl.jit(lambda v: v, **kw), (v,)
        elif case == "same_variable_twice":
            f, args = impl.jit(lambda a, b: a[...] + b[...], **kw), (v, v)
        else:
            f, args = impl.jit(lambda m, x: (m(x), m), **kw), (m, X)
        log.raises("eval_shape", lambda: jax.tree.map(lambda x: x.shape, f.eval_shape(*args)))
        log.raises("call", lambda: jax.tree.map(jnp.shape, f(*args)))
        log.value("v", v[...])
        log.state("m", m)

    parity(scenario)


@modes
def test_aliasing_errors_name_the_variable_by_its_path_in_the_module(kw):
    m = Counter()
    with pytest.raises(ValueError, match="Variable aliasing") as raised:
        nnx_sharding.jit(lambda m: m.linear.kernel, **kw)(m)
    assert "is at args[0].linear.kernel and at out\n" in str(raised.value), raised.value
    if kw["graph"]:  # graph mode keeps shared references
        return
    with pytest.raises(ValueError, match="Variable aliasing") as raised:
        nnx_sharding.jit(lambda a, b: None, **kw)(m, {"k": m.linear.kernel})
    assert "is at args[0].linear.kernel and at args[1]['k']\n" in str(raised.value)


def test_nnx_eval_shape_refuses_shared_variables_where_jit_eval_shape_takes_them():
    """docs/migrating.md: with graph_updates=False, flax's nnx.eval_shape refuses a
    Variable passed twice; flax's jit(...).eval_shape (and its call) take it, and so
    does ours, as jit's."""
    v = nnx.Param(jnp.array(1.0))

    def f(a, b):
        return a[...] + b[...]

    with pytest.raises(ValueError, match="Duplicate"):
        nnx.eval_shape(f, v, v, **MODES["no_updates"])
    theirs = nnx.jit(f, **MODES["no_updates"]).eval_shape(v, v)
    ours = nnx_sharding.jit(f, **MODES["no_updates"]).eval_shape(v, v)
    assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype) == ((), jnp.float32)
    with pytest.raises(ValueError, match="Duplicate"):  # tree mode: all refuse it
        nnx.eval_shape(f, v, v, **MODES["tree"])
    with pytest.raises(ValueError, match="the same Variable is at args"):
        nnx_sharding.jit(f, **MODES["tree"]).eval_shape(v, v)


@modes
def test_captured_variable_returned(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))
        f = impl.jit(lambda x: v, **kw)
        log.raises("call", f, jnp.array(0.0))

    parity(scenario)


# 3. static and donated arguments, shardings


@modes
@pytest.mark.parametrize("static", [dict(static_argnums=(2,)), dict(static_argnames="relu")])
def test_static_argument_with_in_shardings(kw, static):
    x_sharding = NamedSharding(mesh8(), P("x"))

    def fn(x, scale, relu):
        y = x * scale
        return (jnp.maximum(y, 0) if relu else y).sum()

    def scenario(impl, log):
        x = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4)
        f = impl.jit(fn, in_shardings=(x_sharding, None), **static, **kw)
        for i in range(2):
            log.value(f"relu{i}", f(x, 0.5, True))
            log.value(f"plain{i}", f(x, 0.5, False))

    parity(scenario)


@modes
def test_donated_variable_unchanged_keeps_its_value(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))
        f = impl.jit(lambda v: v[...] + 1.0, donate_argnums=0, **kw)
        for i in range(3):
            log.value(f"out{i}", f(v))
            log.value(f"v{i}", v[...])

    parity(scenario)


@modes
def test_donated_module_and_an_updated_variable(kw):
    def scenario(impl, log):
        m = Counter()
        v = nnx.Param(jnp.array(0.0))

        @impl.jit(donate_argnums=(0, 1), **kw)
        def f(m, v, x):
            v[...] += 1.0
            return m(x)

        for i in range(3):
            log.value(f"y{i}", f(m, v, X))
            log.value(f"v{i}", v[...])
        log.state("m", m)

    parity(scenario)


@modes
def test_donated_by_name_passed_as_a_keyword(kw):
    def scenario(impl, log):
        donated, kept = nnx.Param(jnp.array(1.0)), nnx.Param(jnp.array(2.0))
        f = impl.jit(lambda a, b: a[...] + b[...], donate_argnames="a", **kw)
        for i in range(3):
            log.value(f"out{i}", f(a=donated, b=kept))
            log.value(f"values{i}", (donated[...], kept[...]))

    parity(scenario)


@modes
def test_state_sharding_is_an_error(kw):
    rules = nnx.StateSharding({nnx.PathContains("kernel"): NamedSharding(mesh8(), P())})

    def scenario(impl, log):
        log.raises("in", impl.jit, lambda m: m, in_shardings=(rules,), **kw)
        log.raises("out", impl.jit, lambda m: m, out_shardings=rules, **kw)

    parity(scenario)


@modes
def test_variable_as_a_prefix_is_an_error(kw):
    def scenario(impl, log):
        log.raises("in", impl.jit, lambda v: v, in_shardings=(nnx.Param(P()),), **kw)

    parity(scenario)


def test_graph_node_as_a_prefix_in_graph_mode_is_an_error():
    def scenario(impl, log):
        prefix = nnx.Dict(kernel=NamedSharding(mesh8(), P()))
        log.raises("wrap", impl.jit, lambda m: m, in_shardings=(prefix,), **MODES["no_updates"])

    parity(scenario)


@pytest.mark.skipif(not hasattr(nnx, "prefix"), reason="nnx.prefix is new in flax 0.12.8")
def test_tree_prefix_as_out_shardings_lays_a_new_module_out():
    rules = {nnx.PathContains("kernel"): NamedSharding(mesh8(), P(None, "x")), ...: None}

    def scenario(impl, log):
        shardings = nnx.prefix(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), rules, graph=False)

        @impl.jit(out_shardings=shardings, graph=False)
        def make():
            return nnx.Linear(4, 8, rngs=nnx.Rngs(0))

        # and as in_shardings of the module
        g = impl.jit(lambda m: m.kernel[...] * 2, in_shardings=(shardings,), graph=False)
        for i in range(2):
            m = make()
            log.value(f"g{i}", g(m))
            log.sharding(f"kernel{i}", m.kernel[...])
            log.state(f"m{i}", m)

    parity(scenario)


# 4. stages


@modes
def test_lower_compile_and_call_the_compiled(kw):
    def scenario(impl, log):
        class Foo(nnx.Module):
            def __init__(self):
                self.count = nnx.Variable(jnp.array(0))

            @impl.jit(**kw)
            def __call__(self, x):
                self.count[...] += 1
                return x * 2

        m = Foo()
        f = impl.jit(lambda m, x: m(x), **kw)
        compiled = f.lower(m, jnp.array(3.0)).compile()
        log.fact("text", compiled.as_text() is not None)
        log.fact("cost", compiled.cost_analysis() is not None)
        for i in range(3):
            log.value(f"y{i}", compiled(m, jnp.array(3.0)))
            log.value(f"count{i}", m.count[...])

    parity(scenario)


@modes
def test_eval_shape_changes_nothing(kw):
    def scenario(impl, log):
        m = Counter()

        @impl.jit(**kw)
        def f(m, x):
            return m(x), nnx.Linear(2, 5, rngs=nnx.Rngs(1))

        y, new = f.eval_shape(m, X)
        log.fact("y", (y.shape, str(y.dtype)))
        log.fact("new", (type(new).__name__, new.kernel.shape))
        log.state("m", m)

    parity(scenario)


def test_stage_out_tree_is_the_user_output():
    f = nnx_sharding.jit(lambda m, x: (m(x), x), graph=False)
    m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    traced = f.trace(m, X)
    lowered = traced.lower()
    compiled = lowered.compile()
    expected = jax.tree.structure((X @ jnp.ones((2, 3)), X))
    assert lowered.out_tree == compiled.out_tree == expected
    assert jax.tree.structure(traced.out_info) == expected
    assert jax.tree.structure(compiled.output_shardings) == expected


# 5. shard_map


@modes
def test_shard_map_data_parallel_with_a_count(kw):
    def scenario(impl, log):
        m = Counter(din=4, dout=3)

        @impl.shard_map(mesh=mesh8(), in_specs=(P(), P("x")), out_specs=P("x"), **kw)
        def f(m, x):
            return m(x)

        for i in range(2):
            y = f(m, X8)
            log.value(f"y{i}", y)
            log.sharding(f"y_sharding{i}", y)
        log.state("m", m)

    parity(scenario)


@modes
def test_shard_map_same_variable_twice(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.ones(8))
        f = impl.shard_map(
            lambda a, b: a[...] + b[...], mesh=mesh8(), in_specs=(P(), P()), out_specs=P(), **kw
        )
        log.raises("call", f, v, v)

    parity(scenario)


@modes
def test_shard_map_state_sharding_is_an_error(kw):
    rules = nnx.StateSharding({...: P()})

    def scenario(impl, log):
        log.raises(
            "wrap",
            impl.shard_map,
            lambda m: m,
            mesh=mesh8(),
            in_specs=(rules,),
            out_specs=P(),
            **kw,
        )

    parity(scenario)


def test_value_updates_match_numpy():
    """A reference outside flax: tree mode's counted update equals the eager one."""
    m = Counter()
    f = nnx_sharding.jit(lambda m, x: m(x), graph=False)
    want = np.asarray(m.linear(X))
    np.testing.assert_allclose(np.asarray(f(m, X)), want, rtol=1e-6)
    assert int(m.calls[...]) == 1


# 6. prefixes of shared Variables, and what ours does differently (docs/migrating.md)


@pytest.mark.parametrize("entries", ["different", "same", "one_none"])
def test_shared_variable_given_two_prefix_entries(entries):
    s1, s2 = NamedSharding(mesh8(), P("x")), NamedSharding(mesh8(), P())
    shardings = {"different": (s1, s2), "same": (s1, s1), "one_none": (s1, None)}[entries]

    def scenario(impl, log):
        a = nnx.Dict(w=nnx.Param(jnp.arange(8.0)))
        b = nnx.Dict(w=a.w)
        f = impl.jit(
            lambda a, b: a.w[...] + b.w[...], in_shardings=shardings, **MODES["no_updates"]
        )
        for i in range(2):
            out = log.raises(f"call{i}", f, a, b)
            if out is not None:
                log.sharding(f"sharding{i}", out)

    parity(scenario)


@pytest.mark.parametrize("kw", [MODES["no_updates"], MODES["tree"]], ids=["no_updates", "tree"])
def test_donated_by_name_passed_positionally_keeps_its_value(kw):
    """flax donates the buffer (jax resolves the name) but does not write the new one
    back: the Variable is left holding a deleted array. Ours writes it back."""
    v, w = nnx.Param(jnp.array(1.0)), nnx.Param(jnp.array(2.0))
    flax_f = nnx.jit(lambda a, b: a[...] + b[...], donate_argnames="a", **kw)
    assert float(flax_f(v, w)) == 3.0
    assert v.get_raw_value().is_deleted()  # flax's data loss
    v = nnx.Param(jnp.array(1.0))
    f = nnx_sharding.jit(lambda a, b: a[...] + b[...], donate_argnames="a", **kw)
    for _ in range(3):
        assert float(f(v, w)) == 3.0
        assert not v.get_raw_value().is_deleted()
        assert float(v[...]) == 1.0


# 7. when the mode is decided: when jit/shard_map is called, as flax decides it


@pytest.mark.parametrize("where", ["made_inside", "called_inside", "factory_inside"])
def test_mode_is_read_from_the_context_when_jit_is_called(where):
    def grow(m):
        m.calls[...] += 1
        m.extra = nnx.Param(jnp.ones(()))
        return m.calls[...]

    def scenario(impl, log):
        m = Counter()
        if where == "made_inside":
            with nnx.set_graph_mode(False):
                f = impl.jit(grow)
        elif where == "factory_inside":
            with nnx.set_graph_mode(False):
                decorate = impl.jit(donate_argnums=())
            f = decorate(grow)
        else:
            f = impl.jit(grow)
        for i in range(2):
            if where == "called_inside":
                with nnx.set_graph_mode(False):
                    log.value(f"out{i}", f(m))
            else:
                log.value(f"out{i}", f(m))
            log.fact(f"extra{i}", hasattr(m, "extra"))
            if hasattr(m, "extra"):
                del m.extra
        log.state("m", m)

    parity(scenario)


# 8. shard_map: Variables as arguments, States of specs, shared Variables


@modes
def test_shard_map_variables_with_their_specs(kw):
    def scenario(impl, log):
        w = nnx.Param(jnp.arange(32.0).reshape(4, 8))
        b = nnx.Param(jnp.ones(8))
        count = nnx.BatchStat(jnp.array(0))

        @impl.shard_map(mesh=mesh8(), in_specs=(P(None, "x"), P(), P()), out_specs=P(), **kw)
        def f(w, b, count):
            count[...] += 1
            return jnp.array(w.shape[1]) + b[...].sum()

        log.value("out", f(w, b, count))
        log.value("values", (w[...], b[...], count[...]))
        log.sharding("shardings", (w[...], b[...], count[...]))

    parity(scenario)


@modes
def test_shard_map_state_of_specs(kw):
    def scenario(impl, log):
        m = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        specs = nnx.State({"kernel": P(None, "x"), "bias": P()})

        @impl.shard_map(mesh=mesh8(), in_specs=(specs,), out_specs=P(), **kw)
        def f(s):
            m = nnx.merge(graphdef, s)
            return jnp.array(m.kernel.shape[1])

        log.value("out", f(state))

    parity(scenario)


@modes
def test_shard_map_variable_shared_by_two_modules(kw):
    def scenario(impl, log):
        v = nnx.Param(jnp.array(1.0))
        c1, c2 = nnx.Dict(v=v), nnx.Dict(v=v)

        @impl.shard_map(mesh=mesh8(), in_specs=(P(), P(), P()), out_specs=P(), **kw)
        def f(c1, c2, x):
            c1.v[...] += x
            return c1.v[...] + c2.v[...]

        log.raises("call", f, c1, c2, jnp.array(1.0))
        log.value("v", v[...])

    parity(scenario)


def test_shard_map_shared_variable_given_two_specs():
    def scenario(impl, log):
        v = nnx.Param(jnp.arange(8.0))
        f = impl.shard_map(
            lambda a, b: (a[...] + b[...]).sum(),
            mesh=mesh8(),
            in_specs=(P(), P("x")),
            out_specs=P(),
            check_vma=False,
            **MODES["no_updates"],
        )
        log.raises("call", f, v, v)

    parity(scenario)


def test_wrappers_of_both_modes_on_one_model_keep_their_semantics():
    """One model called in turn by a graph-mode and a tree-mode jit of one function: each
    call has its own mode's semantics (the graph mode's cached split included)."""

    def grow(m, x):
        m.calls[...] += 1
        if hasattr(m, "extra"):
            m.extra[...] += 1.0
        else:
            m.extra = nnx.Param(jnp.zeros(()))
        return m(x)

    def scenario(impl, log):
        m = Counter()
        full, tree = impl.jit(grow), impl.jit(grow, graph=False)
        for i, f in enumerate([full, tree, full, full, tree, tree, full]):
            log.value(f"y{i}", f(m, X))
            log.state(f"m{i}", m)

    parity(scenario)


@modes
def test_shard_map_stages_of_ours_match_its_calls(kw):
    """flax's simple shard_map has no stages; ours has them, with the call's results."""

    def fwd(m, x):
        m.calls[...] += 1
        return m(x)

    m, ref = Counter(din=4, dout=3), Counter(din=4, dout=3)
    f = nnx_sharding.shard_map(fwd, mesh=mesh8(), in_specs=(P(), P("x")), out_specs=P("x"), **kw)
    shape = f.eval_shape(m, X8)
    assert (shape.shape, int(m.calls[...])) == ((8, 3), 0)
    compiled = f.lower(m, X8).compile()
    assert compiled.out_tree == jax.tree.structure(X8)
    for i in range(1, 3):
        np.testing.assert_allclose(np.asarray(compiled(m, X8)), np.asarray(f(ref, X8)), 1e-6)
        assert int(m.calls[...]) == int(ref.calls[...]) == 2 * i  # fwd and Counter count
